//! Several "nodes" on one machine, for the multi-node and MPI tests: network namespaces joined
//! by veth pairs through a bridge, addresses from 10.77.0.0/24 that exist only inside this
//! test's own namespaces. Needs root and iproute2 (`ip`); [`cluster`] says why not otherwise.
//! Namespaces, bridge and links are named uniquely per run and removed by a guard, also when a
//! test fails.

#![allow(dead_code)]

use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};

/// A virtual cluster: `nodes` network namespaces on one bridge.
pub struct Cluster {
    /// Namespace names, one per node.
    pub nodes: Vec<String>,
    /// The bridge's name (in the host namespace).
    bridge: String,
    /// The host ends of the veth pairs.
    links: Vec<String>,
}

/// Runs `ip args..`; the error names the command and what it printed.
fn ip(args: &[&str]) -> Result<(), String> {
    run("ip", args)
}

/// Runs `program args..`; the error names the command and what it printed.
fn run(program: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{program} {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{program} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Cluster {
    /// Creates `n` nodes; `Err` says why it cannot be done here (the caller skips).
    pub fn create(n: usize) -> Result<Cluster, String> {
        if !nix::unistd::geteuid().is_root() {
            return Err("not running as root".into());
        }
        if Command::new("ip")
            .arg("-V")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_err()
        {
            return Err("the `ip` tool (iproute2) is not installed".into());
        }
        static CLUSTERS: AtomicUsize = AtomicUsize::new(0);
        let id = format!(
            "{}x{}",
            std::process::id() % 100_000,
            CLUSTERS.fetch_add(1, Ordering::Relaxed)
        );
        // Interface names have at most 15 bytes: "cb" + 5 digits + "x" + a few.
        let mut cluster = Cluster {
            nodes: (0..n).map(|i| format!("chorus-{id}-node{i}")).collect(),
            bridge: format!("cb{id}"),
            links: Vec::new(),
        };
        // From here on the guard removes whatever was made, also on error.
        ip(&["link", "add", &cluster.bridge, "type", "bridge"])?;
        ip(&["link", "set", &cluster.bridge, "up"])?;
        for i in 0..n {
            let ns = cluster.nodes[i].clone();
            let (host_end, node_end) = (format!("cv{id}n{i}"), format!("cp{id}n{i}"));
            ip(&["netns", "add", &ns])?;
            ip(&[
                "link", "add", &host_end, "type", "veth", "peer", "name", &node_end,
            ])?;
            cluster.links.push(host_end.clone());
            ip(&["link", "set", &node_end, "netns", &ns])?;
            ip(&["link", "set", &host_end, "master", &cluster.bridge])?;
            ip(&["link", "set", &host_end, "up"])?;
            let addr = format!("{}/24", Cluster::addr(i));
            ip(&["-n", &ns, "addr", "add", &addr, "dev", &node_end])?;
            ip(&["-n", &ns, "link", "set", &node_end, "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        }
        Ok(cluster)
    }

    /// Node `i`'s address.
    pub fn addr(i: usize) -> String {
        format!("10.77.0.{}", 10 + i)
    }

    /// Cuts node `i` off the bridge (its packets go nowhere).
    pub fn unplug(&self, i: usize) {
        ip(&["link", "set", &self.links[i], "down"]).expect("unplug a node");
    }

    /// Shapes both directions of every node's link to `mbit` Mbit/s with tbf: the node's end
    /// limits what it sends, the bridge's end what it receives, as one NIC. The bucket holds
    /// 2 ms of data (a larger one lets a rank that idled send that much unshaped), and TCP
    /// between the nodes runs CUBIC whatever the host's default (BBR leaves up to a fifth
    /// of a shaped link unused when both directions of one connection are busy at once); see
    /// `benches/baselines/sim_vs_shaped.sh`. Every veth end steers packets to a CPU by flow
    /// (RPS), so that a connection's packets arrive in order as on a real NIC: otherwise each
    /// goes to the CPU that took it out of tbf, and TCP reads the reordering as loss.
    pub fn shape(&self, mbit: u32) -> Result<(), String> {
        let (rate, burst) = (format!("{mbit}mbit"), (mbit * 250).to_string());
        let tbf = [
            "root", "tbf", "rate", &rate, "burst", &burst, "latency", "100ms",
        ];
        let mask = rps_mask();
        for (ns, host_end) in self.nodes.iter().zip(&self.links) {
            let node_end = host_end.replacen("cv", "cp", 1);
            ip(&[
                "-n",
                ns,
                "route",
                "replace",
                "10.77.0.0/24",
                "dev",
                &node_end,
                "congctl",
                "cubic",
            ])?;
            let mut node = vec!["netns", "exec", ns, "tc", "qdisc", "add", "dev", &node_end];
            node.extend(tbf);
            ip(&node)?;
            let mut host = vec!["qdisc", "add", "dev", host_end.as_str()];
            host.extend(tbf);
            run("tc", &host)?;
            let steer =
                |dev: &str| format!("echo {mask} >/sys/class/net/{dev}/queues/rx-0/rps_cpus");
            ip(&["netns", "exec", ns, "sh", "-c", &steer(&node_end)])?;
            run("sh", &["-c", &steer(host_end)])?;
        }
        Ok(())
    }
}

/// A CPU mask naming every CPU, in the comma-separated 32-bit groups that sysfs reads.
fn rps_mask() -> String {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let groups: Vec<String> = (0..cpus.div_ceil(32))
        .rev()
        .map(|g| {
            let bits = (cpus - 32 * g).min(32);
            format!("{:x}", (1u64 << bits) - 1)
        })
        .collect();
    groups.join(",")
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Deleting a namespace deletes the veth end inside it, and so its peer.
        for ns in &self.nodes {
            let _ = ip(&["netns", "del", ns]);
        }
        for link in &self.links {
            let _ = ip(&["link", "del", link]);
        }
        let _ = ip(&["link", "del", &self.bridge]);
    }
}

/// The cluster, or `None` after printing (past the test harness's capture) why not.
pub fn cluster(n: usize) -> Option<Cluster> {
    match Cluster::create(n) {
        Ok(cluster) => Some(cluster),
        Err(why) => {
            let _ = writeln!(
                std::io::stderr(),
                "skipping: needs root and iproute2 ({why})"
            );
            None
        }
    }
}
