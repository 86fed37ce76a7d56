//! Signed artifacts: an Ed25519 signature over the manifest, which holds every file's size and
//! sha256, so one signature covers the whole artifact.
//!
//! The trust model: an artifact is code (it carries native code the runtime executes).
//! Checksums catch corruption; a signature catches tampering, by anyone without the signing key.
//! `maxc serve` / `run` / `generate` with `--require-signature KEY.pub` verify the manifest's
//! bytes against the signature before anything else of the artifact is read or mapped, and then
//! parse exactly those bytes.
//!
//! Files: `maxc keygen --out PREFIX` writes `PREFIX.key` (the 32-byte secret seed, hex, readable
//! by its owner only) and `PREFIX.pub` (the 32-byte public key, hex); `maxc sign ARTIFACT --key
//! PREFIX.key` writes [`SIGNATURE_FILE`] in the artifact: JSON with the algorithm, the public key
//! and the signature (hex).

use crate::error::{Result, RuntimeError};
use ed25519_dalek::{Signature, Signer, Verifier};
pub use ed25519_dalek::{SigningKey, VerifyingKey};
use std::path::{Path, PathBuf};

/// The signature's file in an artifact directory.
pub const SIGNATURE_FILE: &str = "manifest.sig";

#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct SignatureFile {
    algorithm: String,
    public_key: String,
    signature: String,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> RuntimeError + '_ {
    move |source| RuntimeError::Io {
        path: path.into(),
        source,
    }
}

fn hex_decode<const N: usize>(text: &str) -> Option<[u8; N]> {
    let text = text.trim();
    if text.len() != 2 * N || !text.is_ascii() {
        return None;
    }
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// Writes `text` to `path` through a temporary file beside it, renamed into place.
fn write_atomically(path: &Path, text: &str, private: bool) -> Result<()> {
    let tmp = path.with_extension("tmp");
    {
        use std::io::Write;
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create(true).truncate(true);
        #[cfg(unix)]
        if private {
            use std::os::unix::fs::OpenOptionsExt;
            options.mode(0o600);
        }
        #[cfg(not(unix))]
        let _ = private;
        let mut f = options.open(&tmp).map_err(io(&tmp))?;
        f.write_all(text.as_bytes()).map_err(io(&tmp))?;
        f.sync_all().map_err(io(&tmp))?;
    }
    std::fs::rename(&tmp, path).map_err(io(path))
}

/// Makes a key pair from the operating system's randomness and writes `PREFIX.key` and
/// `PREFIX.pub`; refuses to replace existing files. Returns both paths.
pub fn keygen(prefix: &Path) -> Result<(PathBuf, PathBuf)> {
    let name = |ext: &str| {
        let mut p = prefix.as_os_str().to_owned();
        p.push(ext);
        PathBuf::from(p)
    };
    let (key, public) = (name(".key"), name(".pub"));
    for p in [&key, &public] {
        if p.exists() {
            return Err(RuntimeError::artifact(
                p,
                "exists; keygen does not replace keys (choose another --out)",
            ));
        }
    }
    let mut seed = [0u8; 32];
    getrandom::fill(&mut seed).map_err(|e| {
        RuntimeError::Input(format!("the operating system gave no randomness: {e}"))
    })?;
    let signing = SigningKey::from_bytes(&seed);
    write_atomically(&key, &format!("{}\n", maxc_schema::hex(&seed)), true)?;
    write_atomically(
        &public,
        &format!("{}\n", maxc_schema::hex(signing.verifying_key().as_bytes())),
        false,
    )?;
    Ok((key, public))
}

/// The signing key in `path` (a `.key` file of [`keygen`]).
pub fn read_signing_key(path: &Path) -> Result<SigningKey> {
    let text = std::fs::read_to_string(path).map_err(io(path))?;
    let seed = hex_decode::<32>(&text).ok_or_else(|| {
        RuntimeError::artifact(
            path,
            "not a maxc signing key: expected 64 hex digits (a .key file of `maxc keygen`)",
        )
    })?;
    Ok(SigningKey::from_bytes(&seed))
}

/// The public key in `path` (a `.pub` file of [`keygen`]).
pub fn read_verifying_key(path: &Path) -> Result<VerifyingKey> {
    let text = std::fs::read_to_string(path).map_err(io(path))?;
    let bytes = hex_decode::<32>(&text).ok_or_else(|| {
        RuntimeError::artifact(
            path,
            "not a maxc public key: expected 64 hex digits (a .pub file of `maxc keygen`)",
        )
    })?;
    VerifyingKey::from_bytes(&bytes)
        .map_err(|e| RuntimeError::artifact(path, format!("not a valid Ed25519 public key: {e}")))
}

/// Signs the manifest of the artifact at `dir` with `key`, writing [`SIGNATURE_FILE`] (replacing
/// an earlier signature). Returns the signature file's path.
pub fn sign(dir: &Path, key: &SigningKey) -> Result<PathBuf> {
    let manifest = dir.join(crate::schema::MANIFEST_FILE);
    let bytes = std::fs::read(&manifest).map_err(|e| {
        RuntimeError::artifact(
            &manifest,
            format!("cannot read the manifest ({e}); is this a maxc artifact?"),
        )
    })?;
    let file = SignatureFile {
        algorithm: "ed25519".into(),
        public_key: maxc_schema::hex(key.verifying_key().as_bytes()),
        signature: maxc_schema::hex(&key.sign(&bytes).to_bytes()),
    };
    let path = dir.join(SIGNATURE_FILE);
    let text = serde_json::to_string_pretty(&file)
        .map_err(|e| RuntimeError::Input(format!("signature: {e}")))?;
    write_atomically(&path, &(text + "\n"), false)?;
    Ok(path)
}

/// Checks that `manifest` (the bytes of the manifest of the artifact at `dir`) carries a valid
/// signature by `key`; the error says whether the artifact is unsigned, signed by another key,
/// or altered since it was signed.
pub fn verify(dir: &Path, manifest: &[u8], key: &VerifyingKey) -> Result<()> {
    let path = dir.join(SIGNATURE_FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(RuntimeError::artifact(
                &path,
                "missing: the artifact is not signed, and a signature is required (`maxc sign`)",
            ))
        }
        Err(e) => return Err(io(&path)(e)),
    };
    let file: SignatureFile = serde_json::from_str(&text)
        .map_err(|e| RuntimeError::artifact(&path, format!("not a maxc signature file: {e}")))?;
    if file.algorithm != "ed25519" {
        return Err(RuntimeError::artifact(
            &path,
            format!("algorithm `{}`, expected `ed25519`", file.algorithm),
        ));
    }
    let signer = hex_decode::<32>(&file.public_key);
    if signer != Some(*key.as_bytes()) {
        return Err(RuntimeError::artifact(
            &path,
            format!(
                "signed by key {}, not by the required key {}",
                file.public_key,
                maxc_schema::hex(key.as_bytes())
            ),
        ));
    }
    let signature = hex_decode::<64>(&file.signature)
        .map(|b| Signature::from_bytes(&b))
        .ok_or_else(|| {
            RuntimeError::artifact(&path, "`signature` is not 128 hex digits (64 bytes)")
        })?;
    key.verify(manifest, &signature).map_err(|_| {
        RuntimeError::artifact(
            &path,
            "the signature does not match the manifest: the artifact was changed after it was signed",
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trips_and_rejects_bad_text() {
        let bytes = [0u8, 1, 0xab, 0xff];
        assert_eq!(hex_decode::<4>(&maxc_schema::hex(&bytes)), Some(bytes));
        assert_eq!(hex_decode::<4>("00010aBfF"), None);
        assert_eq!(hex_decode::<4>("0001abzz"), None);
        assert_eq!(hex_decode::<2>("é1"), None);
    }
}
