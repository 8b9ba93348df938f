//! The cores a host's ranks may run on: the union of their affinity masks,
//! bounded by a CPU quota where one binds. Every local rank publishes its own
//! [`Cores`] at set-up and counts the same union, so they agree on whether they
//! outnumber their cores.

use std::fmt;
use std::str::FromStr;

/// Words in a mask: `cpu_set_t` holds 1024 CPUs.
const WORDS: usize = 1024 / 64;

/// The CPUs one process may run on, and the cores a CPU quota allows it (if
/// that binds: fewer than its mask holds).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Cores {
    mask: [u64; WORDS],
    quota: Option<usize>,
}

impl Cores {
    /// This process's: its affinity mask (every CPU if it cannot be read) and
    /// what the standard library reports a quota leaves it.
    pub fn of_this_process() -> Cores {
        let mut mask = [u64::MAX; WORDS];
        // SAFETY: `set` is a plain bit set the call fills; its size is passed.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) == 0 {
                mask = [0; WORDS];
                for cpu in 0..WORDS * 64 {
                    if libc::CPU_ISSET(cpu, &set) {
                        mask[cpu / 64] |= 1 << (cpu % 64);
                    }
                }
            }
        }
        let cores = Cores { mask, quota: None };
        let allowed = std::thread::available_parallelism().map_or(1, |n| n.get());
        Cores {
            quota: (allowed < cores.count()).then_some(allowed),
            ..cores
        }
    }

    /// CPUs in the mask.
    fn count(&self) -> usize {
        self.mask.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// Cores that processes of these `cores` share: the CPUs any of them may run on,
    /// at most the largest quota where every one has a quota (at least one).
    pub fn shared(cores: &[Cores]) -> usize {
        let mut union = [0u64; WORDS];
        for c in cores {
            for (u, w) in union.iter_mut().zip(c.mask) {
                *u |= w;
            }
        }
        let cpus = Cores {
            mask: union,
            quota: None,
        }
        .count();
        let quota = cores
            .iter()
            .map(|c| c.quota)
            .try_fold(0, |most, q| Some(most.max(q?)));
        cpus.min(quota.unwrap_or(usize::MAX)).max(1)
    }
}

/// `quota/word.word...` (hex words, `-` for no quota), as published at set-up.
impl fmt::Display for Cores {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.quota {
            Some(q) => write!(f, "{q}/")?,
            None => f.write_str("-/")?,
        }
        let words: Vec<String> = self.mask.iter().map(|w| format!("{w:x}")).collect();
        f.write_str(&words.join("."))
    }
}

impl FromStr for Cores {
    type Err = String;

    fn from_str(s: &str) -> Result<Cores, String> {
        let bad = || format!("bad cores '{s}'");
        let (quota, words) = s.split_once('/').ok_or_else(bad)?;
        let quota = match quota {
            "-" => None,
            q => Some(q.parse().map_err(|_| bad())?),
        };
        let mut mask = [0u64; WORDS];
        let mut words = words.split('.');
        for w in &mut mask {
            *w = u64::from_str_radix(words.next().ok_or_else(bad)?, 16).map_err(|_| bad())?;
        }
        match words.next() {
            Some(_) => Err(bad()),
            None => Ok(Cores { mask, quota }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on(cpus: &[usize], quota: Option<usize>) -> Cores {
        let mut mask = [0; WORDS];
        for &c in cpus {
            mask[c / 64] |= 1 << (c % 64);
        }
        Cores { mask, quota }
    }

    #[test]
    fn ranks_share_the_union_of_their_masks_up_to_a_quota() {
        // Pinned one a core: four cores between them.
        let pinned: Vec<Cores> = (0..4).map(|c| on(&[c], None)).collect();
        assert_eq!(Cores::shared(&pinned), 4);
        // Two ranks on the same two CPUs, and one on a third far away.
        let overlapping = [on(&[0, 1], None), on(&[0, 1], None), on(&[200], None)];
        assert_eq!(Cores::shared(&overlapping), 3);
        // A container's quota of two cores on a 64-CPU mask binds every rank.
        let all: Vec<usize> = (0..64).collect();
        let quota = [on(&all, Some(2)), on(&all, Some(2))];
        assert_eq!(Cores::shared(&quota), 2);
        // A rank without a quota lifts the bound.
        assert_eq!(Cores::shared(&[on(&all, Some(2)), on(&all, None)]), 64);
    }

    #[test]
    fn cores_travel_as_text() {
        let mine = Cores::of_this_process();
        assert!(mine.count() >= 1);
        assert_eq!(mine.to_string().parse::<Cores>(), Ok(mine));
        let c = on(&[1, 70, 1023], Some(3));
        assert_eq!(c.to_string().parse::<Cores>(), Ok(c));
        for bad in [
            "",
            "3",
            "x/0",
            "-/0.0",
            "-/zz.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0",
        ] {
            assert!(bad.parse::<Cores>().is_err(), "{bad}");
        }
    }
}
