//! Two "hosts" on this machine: network namespaces joined by a veth pair, each with its own
//! address and hostname, made on creation and removed on drop. `mpirun` runs in the first and
//! starts the second's ranks through a launcher script standing in for ssh, so ranks on
//! different hosts talk over TCP across the veth pair, as over a network.

use std::path::PathBuf;
use std::process::Command;

pub struct TwoHosts {
    names: [String; 2],
    addrs: [&'static str; 2],
    agent: PathBuf,
    _dir: tempfile::TempDir,
}

/// Runs `ip args..`; its error output where it fails.
fn ip(args: &[&str]) -> Result<(), String> {
    let o = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip: {e}"))?;
    if o.status.success() {
        return Ok(());
    }
    Err(format!(
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&o.stderr).trim()
    ))
}

impl TwoHosts {
    /// The two namespaces and the link between them; an error naming the step where this
    /// machine does not allow it (network namespaces need root, or CAP_NET_ADMIN).
    pub fn new() -> Result<Self, String> {
        let id = std::process::id();
        let names = [format!("maxc-{id}-a"), format!("maxc-{id}-b")];
        let links = [format!("mx{id}a"), format!("mx{id}b")];
        let addrs = ["10.77.0.1", "10.77.0.2"];
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let agent = dir.path().join("netns-rsh");
        // Open MPI calls its remote launcher as `AGENT [options] HOST COMMAND...`.
        let script = format!(
            "#!/bin/sh\nwhile [ $# -gt 0 ]; do case \"$1\" in -*) shift;; *) break;; esac; done\n\
             host=$1; shift\n\
             case \"$host\" in {a0}) ns={n0};; {a1}) ns={n1};; *) echo \"no host $host\" >&2; exit 1;; esac\n\
             exec ip netns exec $ns unshare --uts sh -c \"hostname $ns; $*\"\n",
            a0 = addrs[0],
            a1 = addrs[1],
            n0 = names[0],
            n1 = names[1]
        );
        std::fs::write(&agent, script).map_err(|e| e.to_string())?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&agent, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| e.to_string())?;
        let hosts = TwoHosts {
            names,
            addrs,
            agent,
            _dir: dir,
        };
        // Dropping `hosts` on an error removes what was made.
        for n in &hosts.names {
            ip(&["netns", "add", n])?;
        }
        ip(&[
            "link", "add", &links[0], "type", "veth", "peer", "name", &links[1],
        ])?;
        for i in 0..2 {
            let (n, l) = (&hosts.names[i], &links[i]);
            ip(&["link", "set", l, "netns", n])?;
            ip(&[
                "-n",
                n,
                "addr",
                "add",
                &format!("{}/24", addrs[i]),
                "dev",
                l,
            ])?;
            ip(&["-n", n, "link", "set", "lo", "up"])?;
            ip(&["-n", n, "link", "set", l, "up"])?;
        }
        Ok(hosts)
    }

    /// The command line that runs a program as `ranks` ranks spread over both hosts: `mpirun`
    /// in the first namespace, TCP between the hosts over the veth pair alone.
    pub fn launcher(&self, ranks: usize) -> Vec<String> {
        let subnet = "10.77.0.0/24";
        let slots = ranks.div_ceil(2);
        let mut v: Vec<String> = ["ip", "netns", "exec", &self.names[0]]
            .iter()
            .map(|s| s.to_string())
            .collect();
        v.extend(["unshare", "--uts", "--"].map(String::from));
        // `hostname` of the first host, then mpirun (an `env` program keeps argv as given).
        v.extend([
            "sh".to_string(),
            "-c".to_string(),
            format!("hostname {} && exec \"$@\"", self.names[0]),
            "sh".to_string(),
        ]);
        v.extend(
            [
                "mpirun",
                "--allow-run-as-root",
                "--oversubscribe",
                "--host",
                &format!("{}:{slots},{}:{slots}", self.addrs[0], self.addrs[1]),
                "--map-by",
                "node",
                "-np",
                &ranks.to_string(),
                "--mca",
                "plm_rsh_agent",
                self.agent.to_str().unwrap(),
                "--mca",
                "btl",
                "tcp,self",
                "--mca",
                "btl_tcp_if_include",
                subnet,
                "--mca",
                "oob_tcp_if_include",
                subnet,
            ]
            .map(String::from),
        );
        v
    }
}

impl Drop for TwoHosts {
    /// Removing the namespaces removes the veth pair with them.
    fn drop(&mut self) {
        for n in &self.names {
            let _ = ip(&["netns", "del", n]);
        }
    }
}
