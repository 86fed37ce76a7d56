//! `maxc keygen --out PREFIX` and `maxc sign ARTIFACT --key PREFIX.key`: Ed25519 keys and
//! artifact signatures (see `maxc_runtime::signature` for the trust model).

use anyhow::Result;
use maxc_runtime::signature;
use std::path::PathBuf;

/// Arguments of `maxc keygen`.
#[derive(clap::Args, Debug)]
pub struct KeygenArgs {
    /// Writes PREFIX.key (secret, owner-only) and PREFIX.pub.
    #[arg(long)]
    out: PathBuf,
}

/// Arguments of `maxc sign`.
#[derive(clap::Args, Debug)]
pub struct SignArgs {
    /// The artifact directory.
    artifact: PathBuf,
    /// The signing key (a .key file of `maxc keygen`).
    #[arg(long)]
    key: PathBuf,
}

/// The `--require-signature` option of the commands that load an artifact.
#[derive(clap::Args, Debug, Default)]
pub struct RequireSignature {
    /// Refuse the artifact unless its manifest is signed by this public key (a .pub file of
    /// `maxc keygen`), checked before anything else of the artifact is read.
    #[arg(long, value_name = "PUBKEY")]
    pub require_signature: Option<PathBuf>,
}

impl RequireSignature {
    /// The key, read from its file.
    pub fn key(&self) -> Result<Option<signature::VerifyingKey>> {
        Ok(match &self.require_signature {
            Some(p) => Some(signature::read_verifying_key(p)?),
            None => None,
        })
    }
}

/// Writes a new key pair.
pub fn keygen(args: KeygenArgs) -> Result<()> {
    let (key, public) = signature::keygen(&args.out)?;
    println!(
        "wrote {} (secret: keep it private) and {}",
        key.display(),
        public.display()
    );
    Ok(())
}

/// Signs an artifact's manifest.
pub fn sign(args: SignArgs) -> Result<()> {
    let key = signature::read_signing_key(&args.key)?;
    // Only a whole, valid artifact is signed: its files must match the manifest now.
    maxc_runtime::Artifact::open(&args.artifact)?;
    let path = signature::sign(&args.artifact, &key)?;
    println!("wrote {}", path.display());
    Ok(())
}
