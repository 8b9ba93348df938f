//! The names of every environment variable Chorus reads or sets, in one place (the crate
//! `chorus-env`, which the launcher shares, and the GPU kernels' own).
//!
//! Each constant is named for its variable and holds the variable's name, so code reads
//! `std::env::var(env::CHORUS_TIMEOUT)` and a search for the name finds every use. The
//! defaults live beside the code that applies them ([`DEFAULT_TIMEOUT`](crate::DEFAULT_TIMEOUT)
//! and its siblings); the table of environment variables in `docs/environment.md` lists
//! every name here, with its meaning and default. `Lookup`, `optional` and `bad` are how
//! configuration reads them.

use crate::Error;

pub use chorus_env::*;
pub use chorus_kernels::env::{
    CHORUS_CUDA_CACHE, CHORUS_REQUIRE_CUDA, CUDA_HOME, CUDA_PATH, CUDA_ROOT, HOME, XDG_CACHE_HOME,
};

/// How configuration reads a variable: its value, or `None` when unset.
pub(crate) type Lookup<'a> = &'a dyn Fn(&str) -> Option<String>;

/// The error for `var` set to `value`, which is wrong for `reason`.
pub(crate) fn bad(var: &'static str, value: &str, reason: &str) -> Error {
    Error::Config {
        var,
        value: value.to_string(),
        reason: reason.to_string(),
    }
}

/// Parses a size in bytes: `8`, `64K`, `256M`, `1G` (powers of 1024, either case).
pub fn parse_size(s: &str) -> std::result::Result<usize, String> {
    let s = s.trim();
    let (digits, shift) = match s.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&s[..s.len() - 1], 10),
        Some('M') => (&s[..s.len() - 1], 20),
        Some('G') => (&s[..s.len() - 1], 30),
        _ => (s, 0),
    };
    let n: usize = digits.parse().map_err(|e| format!("bad size '{s}': {e}"))?;
    n.checked_mul(1 << shift)
        .ok_or_else(|| format!("size '{s}' is too large"))
}

/// `var` parsed as a `T`: `None` when unset or blank; fails naming the variable.
pub(crate) fn optional<T: std::str::FromStr>(
    get: Lookup<'_>,
    var: &'static str,
) -> Result<Option<T>, Error>
where
    T::Err: std::fmt::Display,
{
    match get(var) {
        None => Ok(None),
        Some(v) if v.trim().is_empty() => Ok(None),
        Some(v) => v
            .trim()
            .parse()
            .map(Some)
            .map_err(|e: T::Err| bad(var, &v, &e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    /// The variable names a file of `pub const NAME: &str = "VALUE";` lines defines.
    fn defined(source: &str) -> BTreeSet<String> {
        source
            .lines()
            .filter_map(|line| line.strip_prefix("pub const "))
            .filter_map(|rest| rest.split('"').nth(1))
            .filter(|name| *name != super::CHORUS_PREFIX)
            // Names of variables, not values such as DEFAULT_MASTER_ADDR's.
            .filter(|name| {
                name.bytes()
                    .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
            })
            .map(str::to_string)
            .collect()
    }

    /// The names in the first column of the table of environment variables in
    /// `docs/environment.md`.
    fn documented(page: &str) -> BTreeSet<String> {
        let section = page
            .split("# Environment variables")
            .nth(1)
            .expect("docs/environment.md has a section on environment variables");
        section
            .lines()
            .skip_while(|line| !line.starts_with('|'))
            .take_while(|line| line.starts_with('|'))
            .skip(2)
            .filter_map(|row| row.split('|').nth(1))
            .flat_map(|cell| cell.split('`').skip(1).step_by(2))
            .map(str::to_string)
            .collect()
    }

    #[test]
    fn the_environment_page_lists_every_variable_and_no_other() {
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
        let read = |path: &str| {
            std::fs::read_to_string(format!("{root}/{path}"))
                .unwrap_or_else(|e| panic!("{path}: {e}"))
        };
        let mut names = defined(&read("env/src/lib.rs"));
        names.extend(defined(&read("kernels/src/env.rs")));
        let table = documented(&read("docs/environment.md"));
        let undocumented: Vec<_> = names.difference(&table).collect();
        let unknown: Vec<_> = table.difference(&names).collect();
        assert!(
            undocumented.is_empty() && unknown.is_empty(),
            "not in docs/environment.md's table: {undocumented:?}; in the table but not in \
             chorus::env: {unknown:?}"
        );
    }
}
