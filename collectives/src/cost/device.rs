//! What the device paths cost: closed forms for CUDA IPC, staging and the hierarchical
//! plan (see `chorus::cuda`), from the links a GPU job has. A device communicator picks
//! its path with them ([`pick`]), and `chorus_sim --device` prints them.
//!
//! Each path is priced by the bytes each rank moves over each link, the links of a host
//! overlapping (a path's stages are pipelined in chunks, so the slowest link bounds it):
//!
//! - IPC, one host of `W` ranks: a copy of the buffer into the rank's scratch memory, then
//!   its share of the collective read from the peers' scratch over the GPUs' links, two
//!   host barriers per round of 64 MiB.
//! - Staged: the collective's share over the link between ranks (the network across hosts,
//!   host memory within one; a ring crosses each host's network link once, while an
//!   all-to-all's ranks share it), every byte also crossing PCIe to and from pinned memory.
//! - Hierarchical, `H` hosts of up to `L` ranks: the IPC stages within a host, then the
//!   owners of each shard move it between hosts. A host's owners share its network link,
//!   which carries a whole buffer's share of the collective among `H` hosts, while each
//!   owner's PCIe carries only its shard's. The IPC stages are added to the crossing: the
//!   path's rounds overlap them, but by how much is for a GPU's measurements to say, so
//!   the sum stands as the bound.
//!
//! The figures of [`DeviceLinks::assumed`] are not measured on a GPU: they are typical of
//! a machine of PCIe 4 and a GPU interconnect, and say which path wins rather than how
//! fast it runs.

use super::LinkModel;
use crate::algorithm::Collective;
pub use crate::algorithm::DevicePath;

/// Bytes of the rounds the IPC stages run in (the IPC path's half scratch buffer).
const ROUND_BYTES: f64 = (64 << 20) as f64;

/// The size a device communicator prices its paths at when it picks one: the paths differ
/// in bandwidth, which large calls show.
pub const PICK_BYTES: usize = 64 << 20;

/// The links of a GPU job.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceLinks {
    /// Between two GPUs of one host through CUDA IPC (`alpha`: a host barrier).
    pub peer: LinkModel,
    /// Between a GPU and pinned host memory, each direction.
    pub pcie: LinkModel,
    /// Between hosts: the host transport's link, one per host, shared by its ranks.
    pub network: LinkModel,
    /// Between ranks of one host through host memory (the staged path on one host).
    pub host: LinkModel,
}

impl DeviceLinks {
    /// Figures assumed where none are measured (not calibrated on a GPU): CUDA IPC at
    /// 100 GB/s with 20 us a barrier, PCIe at 20 GB/s with 10 us a copy, shared memory as
    /// the tuner prices it, and `network` between hosts.
    pub fn assumed(network: LinkModel) -> DeviceLinks {
        DeviceLinks {
            peer: LinkModel::new(20e-6, 100e9),
            pcie: LinkModel::new(10e-6, 20e9),
            network,
            host: LinkModel::shared_memory(),
        }
    }
}

/// Where a GPU job's ranks are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceLayout {
    /// How many ranks.
    pub world: usize,
    /// How many hosts they run on.
    pub hosts: usize,
    /// The most ranks on one host.
    pub most_local: usize,
}

impl DeviceLayout {
    /// The paths that can run on this layout: IPC on one host, the hierarchical path
    /// across hosts of which one runs several ranks, staging anywhere.
    pub fn paths(&self) -> Vec<DevicePath> {
        DevicePath::ALL
            .into_iter()
            .filter(|&p| match p {
                DevicePath::Ipc => self.hosts == 1,
                DevicePath::Staged => true,
                DevicePath::Hierarchical => self.hosts > 1 && self.most_local > 1,
            })
            .collect()
    }
}

/// Predicted seconds of collective `c` on `bytes` (nccl-tests' size: the buffer each rank
/// holds, the larger one of all-gather and reduce-scatter) by `path`; infinite where the
/// path cannot run on `layout`.
pub fn estimate(
    path: DevicePath,
    c: Collective,
    bytes: usize,
    layout: DeviceLayout,
    links: &DeviceLinks,
) -> f64 {
    if !layout.paths().contains(&path) {
        return f64::INFINITY;
    }
    let (s, w) = (bytes as f64, layout.world);
    let (h, l) = (layout.hosts, layout.most_local.max(1));
    match path {
        DevicePath::Ipc => within(c, s, w, &links.peer),
        DevicePath::Staged => {
            let link = if h == 1 { &links.host } else { &links.network };
            let moved = share(c, w) * s;
            // A ring crosses each host's link once; an all-to-all's ranks share it.
            let across = match c {
                Collective::AllToAll if h > 1 => s * (w - l) as f64 / w as f64 * l as f64,
                _ => moved,
            };
            let wire = (across / link.beta).max(moved / links.pcie.beta);
            steps(c, w) * (link.alpha + links.pcie.alpha) + wire
        }
        DevicePath::Hierarchical => {
            // What a host's network link carries, and each owner's PCIe: its shard of it.
            let across = match c {
                Collective::AllToAll => s * (w - l) as f64 / w as f64 * l as f64,
                Collective::Broadcast | Collective::Reduce => s,
                // All-gather and reduce-scatter run as all-reduces of the blocks.
                _ => share(Collective::AllReduce, h) * s,
            };
            let wire = (across / links.network.beta).max(across / l as f64 / links.pcie.beta);
            let latency = steps(c, h) * (links.network.alpha + links.pcie.alpha);
            within(c, s, l, &links.peer) + wire + latency
        }
    }
}

/// The cheapest of `allowed` for `c` on `bytes` (the first of equals).
pub fn pick(
    allowed: &[DevicePath],
    c: Collective,
    bytes: usize,
    layout: DeviceLayout,
    links: &DeviceLinks,
) -> Option<DevicePath> {
    let cost = |p: &DevicePath| estimate(*p, c, bytes, layout, links);
    allowed
        .iter()
        .copied()
        .filter(|p| cost(p).is_finite())
        .min_by(|a, b| cost(a).total_cmp(&cost(b)))
}

/// The IPC stages among `n` ranks of one host: the copy into scratch memory, the reads of
/// the collective's share from the peers', two barriers a round.
fn within(c: Collective, s: f64, n: usize, peer: &LinkModel) -> f64 {
    let rounds = (s / ROUND_BYTES).ceil().max(1.0);
    2.0 * rounds * peer.alpha + (s + share(c, n) * s) / peer.beta
}

/// The fraction of the buffer each of `n` ranks sends (and receives) in collective `c`.
fn share(c: Collective, n: usize) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let rest = (n - 1) as f64 / n as f64;
    match c {
        Collective::AllReduce => 2.0 * rest,
        Collective::Broadcast | Collective::Reduce => 1.0,
        _ => rest,
    }
}

/// Messages in a row each rank waits for among `n` ranks: a ring's steps.
fn steps(c: Collective, n: usize) -> f64 {
    let n = n.saturating_sub(1) as f64;
    match c {
        Collective::AllReduce => 2.0 * n,
        _ => n,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(hosts: usize, most_local: usize) -> DeviceLayout {
        DeviceLayout {
            world: hosts * most_local,
            hosts,
            most_local,
        }
    }

    #[test]
    fn the_paths_follow_the_hosts() {
        assert_eq!(layout(1, 4).paths(), [DevicePath::Ipc, DevicePath::Staged]);
        assert_eq!(
            layout(2, 2).paths(),
            [DevicePath::Staged, DevicePath::Hierarchical]
        );
        assert_eq!(layout(4, 1).paths(), [DevicePath::Staged]);
    }

    #[test]
    fn the_pick_is_ipc_on_one_host_and_hierarchical_across_hosts_of_several_ranks() {
        let links = DeviceLinks::assumed(LinkModel::default());
        for (hosts, most, want) in [
            (1, 2, DevicePath::Ipc),
            (1, 8, DevicePath::Ipc),
            (2, 2, DevicePath::Hierarchical),
            (64, 8, DevicePath::Hierarchical),
            (8, 1, DevicePath::Staged),
        ] {
            let l = layout(hosts, most);
            let c = Collective::AllReduce;
            let got = pick(&l.paths(), c, PICK_BYTES, l, &links);
            assert_eq!(got, Some(want), "{hosts} hosts of {most}");
        }
        // All-gather crosses hosts as an all-reduce on the hierarchical path: on hosts of
        // two, staging's ring moves fewer bytes over the network.
        let l = layout(2, 2);
        let got = pick(&l.paths(), Collective::AllGather, PICK_BYTES, l, &links);
        assert_eq!(got, Some(DevicePath::Staged));
    }

    #[test]
    fn the_hierarchical_path_moves_a_host_s_bytes_once_over_the_network() {
        // Two hosts of four over a 1.5 GB/s link: staging moves 2 * 7/8 of the buffer per
        // rank, the hierarchical path 2 * 1/2 per host, shared by its four owners.
        let links = DeviceLinks::assumed(LinkModel::new(10e-6, 1.5e9));
        let l = layout(2, 4);
        let c = Collective::AllReduce;
        let staged = estimate(DevicePath::Staged, c, PICK_BYTES, l, &links);
        let tiered = estimate(DevicePath::Hierarchical, c, PICK_BYTES, l, &links);
        let s = PICK_BYTES as f64;
        assert!((staged - 1.75 * s / 1.5e9).abs() < 1e-3, "{staged}");
        assert!((tiered - s / 1.5e9).abs() < 0.01, "{tiered}");
        assert_eq!(
            estimate(DevicePath::Ipc, c, PICK_BYTES, l, &links),
            f64::INFINITY
        );
    }
}
