//! SLURM's job description: host lists (`node[01-04,07],login1`), tasks per node
//! (`2(x3),1`), and the store port derived from the job's id.

/// Offset of the store port derived from `SLURM_JOB_ID`.
const SLURM_PORT_BASE: u16 = 10_000;
/// Number of distinct ports derived from `SLURM_JOB_ID`.
const SLURM_PORT_SPAN: u64 = 20_000;

/// The store port of a SLURM job: `10000 + job_id % 20000`.
pub(crate) fn slurm_port(job_id: u64) -> u16 {
    // The remainder is below 20000, so the sum fits in a u16.
    SLURM_PORT_BASE + (job_id % SLURM_PORT_SPAN) as u16
}

/// The number of tasks on node `node` of a `SLURM_TASKS_PER_NODE` list like `2(x3),1`.
pub(crate) fn tasks_on_node(list: &str, node: usize) -> Result<usize, String> {
    let mut first = 0usize;
    for item in list.split(',') {
        let item = item.trim();
        let (count, repeat) = match item.split_once("(x") {
            Some((count, rest)) => {
                let repeat = rest
                    .strip_suffix(')')
                    .ok_or_else(|| format!("unclosed repeat in {item:?}"))?;
                (count, repeat)
            }
            None => (item, "1"),
        };
        let count: usize = count
            .parse()
            .map_err(|_| format!("bad task count {count:?} in {item:?}"))?;
        let repeat: usize = repeat
            .parse()
            .map_err(|_| format!("bad repeat {repeat:?} in {item:?}"))?;
        if node < first.saturating_add(repeat) {
            return Ok(count);
        }
        first = first.saturating_add(repeat);
    }
    Err(format!("lists only {first} nodes"))
}

/// One piece of a host expression: literal text or a bracketed set of numbers.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Text(String),
    /// Inclusive ranges, each with its zero-padded width.
    Numbers(Vec<(u64, u64, usize)>),
}

/// Splits a SLURM host list into host expressions (commas outside brackets) and parses each.
fn parse_hostlist(list: &str) -> Result<Vec<Vec<Piece>>, String> {
    let list = list.trim();
    if list.is_empty() {
        return Err("empty host list".into());
    }
    let mut exprs = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    for (i, c) in list.char_indices() {
        match c {
            '[' if depth == 0 => depth = 1,
            '[' => return Err(format!("nested '[' at byte {i}")),
            ']' if depth == 1 => depth = 0,
            ']' => return Err(format!("unmatched ']' at byte {i}")),
            ',' if depth == 0 => {
                exprs.push(parse_host_expr(&list[start..i])?);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err("unclosed '['".into());
    }
    exprs.push(parse_host_expr(&list[start..])?);
    Ok(exprs)
}

/// Parses `rack[1-2]-node[01-04,07]` into pieces.
fn parse_host_expr(expr: &str) -> Result<Vec<Piece>, String> {
    let expr = expr.trim();
    if expr.is_empty() {
        return Err("empty host name".into());
    }
    let mut pieces = Vec::new();
    let mut rest = expr;
    while !rest.is_empty() {
        match rest.find('[') {
            Some(0) => {
                let close = rest.find(']').ok_or("unclosed '['")?;
                pieces.push(Piece::Numbers(parse_ranges(&rest[1..close])?));
                rest = &rest[close + 1..];
            }
            Some(open) => {
                pieces.push(Piece::Text(rest[..open].to_string()));
                rest = &rest[open..];
            }
            None => {
                pieces.push(Piece::Text(rest.to_string()));
                rest = "";
            }
        }
    }
    Ok(pieces)
}

/// `01-04,07` into `[(1, 4, 2), (7, 7, 2)]`.
fn parse_ranges(spec: &str) -> Result<Vec<(u64, u64, usize)>, String> {
    let number = |s: &str| -> Result<u64, String> {
        if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!("bad number {s:?} in [{spec}]"));
        }
        s.parse().map_err(|_| format!("number {s:?} too large"))
    };
    spec.split(',')
        .map(|part| {
            let part = part.trim();
            let (lo, hi) = part.split_once('-').unwrap_or((part, part));
            let (a, b) = (number(lo)?, number(hi)?);
            if a > b {
                return Err(format!("range {part:?} runs backwards"));
            }
            Ok((a, b, lo.len()))
        })
        .collect()
}

/// Every host of a SLURM host list, lazily: `node[01-03,07],login1` gives `node01`, `node02`,
/// `node03`, `node07`, `login1`; several brackets in one name vary leftmost-slowest
/// (`r[1-2]n[1-2]`: `r1n1`, `r1n2`, `r2n1`, `r2n2`).
///
/// Fails on a malformed list (empty names, unclosed or nested brackets, bad ranges).
pub(crate) fn hosts(list: &str) -> Result<impl Iterator<Item = String>, String> {
    Ok(parse_hostlist(list)?.into_iter().flat_map(expand_expr))
}

/// The names one host expression stands for.
fn expand_expr(pieces: Vec<Piece>) -> Box<dyn Iterator<Item = String>> {
    let start: Box<dyn Iterator<Item = String>> = Box::new(std::iter::once(String::new()));
    pieces.into_iter().fold(start, |names, piece| match piece {
        Piece::Text(text) => Box::new(names.map(move |name| name + &text)),
        Piece::Numbers(ranges) => Box::new(names.flat_map(move |name| {
            ranges.clone().into_iter().flat_map(move |(a, b, width)| {
                let name = name.clone();
                (a..=b).map(move |i| format!("{name}{i:0width$}"))
            })
        })),
    })
}

/// The first host of a SLURM host list (the rest is not expanded).
pub(crate) fn first_host(list: &str) -> Result<String, String> {
    hosts(list)?
        .next()
        .ok_or_else(|| "empty host list".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_lists() {
        let expand = |list: &str| hosts(list).map(|h| h.collect::<Vec<_>>());
        let cases: [(&str, &[&str]); 9] = [
            ("node01", &["node01"]),
            (
                "node[01-04,07]",
                &["node01", "node02", "node03", "node04", "node07"],
            ),
            ("a[1-2],b3", &["a1", "a2", "b3"]),
            ("n[8-10]", &["n8", "n9", "n10"]),
            ("n[098-100]", &["n098", "n099", "n100"]),
            ("r[1-2]n[1-2]", &["r1n1", "r1n2", "r2n1", "r2n2"]),
            ("[1-2]x", &["1x", "2x"]),
            (" gpu[3],login ", &["gpu3", "login"]),
            ("a-b[0-1].c,d[5]", &["a-b0.c", "a-b1.c", "d5"]),
        ];
        for (list, want) in cases {
            assert_eq!(expand(list).unwrap(), want, "{list}");
            assert_eq!(first_host(list).unwrap(), want[0], "{list}");
        }
        // The first host of a huge list without expanding it.
        assert_eq!(first_host("n[0000001-9999999]").unwrap(), "n0000001");
        for (list, needle) in [
            ("", "empty host list"),
            ("a,,b", "empty host name"),
            ("a,", "empty host name"),
            ("n[1-", "unclosed"),
            ("n[]", "bad number \"\""),
            ("n[3-1]", "backwards"),
            ("n[1-2]]", "unmatched ']'"),
            ("n[[1]]", "nested"),
            ("n[a-b]", "bad number \"a\""),
            ("n[1-99999999999999999999]", "too large"),
        ] {
            let err = expand(list).unwrap_err();
            assert!(
                err.contains(needle),
                "{list:?}: {err:?} should mention {needle:?}"
            );
        }
    }

    #[test]
    fn tasks_per_node_lists() {
        assert_eq!(tasks_on_node("4", 0), Ok(4));
        assert_eq!(tasks_on_node("2(x3)", 2), Ok(2));
        assert_eq!(tasks_on_node("2(x3),1", 3), Ok(1));
        assert_eq!(
            tasks_on_node("2(x3),1", 4),
            Err("lists only 4 nodes".into())
        );
        assert!(tasks_on_node("2(x3", 0).unwrap_err().contains("unclosed"));
        assert!(tasks_on_node("x", 0)
            .unwrap_err()
            .contains("bad task count"));
        assert!(tasks_on_node("2(xy)", 0)
            .unwrap_err()
            .contains("bad repeat"));
        assert_eq!(slurm_port(0), 10_000);
        assert_eq!(slurm_port(19_999), 29_999);
        assert_eq!(slurm_port(u64::MAX), 10_000 + (u64::MAX % 20_000) as u16);
    }
}
