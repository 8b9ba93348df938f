//! The documentation's links: every relative link in README.md, docs/ and benches/RESULTS.md
//! names a file that exists, and an anchor names a heading of that file; and the results
//! document's generated parts are what the raw rounds kept beside it give.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The documents checked, from the workspace root.
fn documents(root: &Path) -> Vec<PathBuf> {
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("docs/ is readable")
        .map(|entry| entry.expect("a docs/ entry").path())
        .filter(|path| path.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.extend([root.join("README.md"), root.join("benches/RESULTS.md")]);
    docs.sort();
    docs
}

/// GitHub's anchor for a heading: lower case, spaces to dashes, other punctuation dropped.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// A Markdown text's lines outside fenced code blocks.
fn prose(text: &str) -> impl Iterator<Item = &str> {
    let mut fenced = false;
    text.lines().filter(move |line| {
        let fence = line.trim_start().starts_with("```");
        fenced ^= fence;
        !fence && !fenced
    })
}

/// The anchors of a Markdown text's headings.
fn anchors(text: &str) -> BTreeSet<String> {
    prose(text)
        .filter(|line| line.starts_with('#'))
        .map(|line| anchor(line.trim_start_matches('#')))
        .collect()
}

/// The targets of a Markdown text's inline links `[text](target)`.
fn links(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    for line in prose(text) {
        for (i, _) in line.match_indices("](") {
            let rest = &line[i + 2..];
            if let Some(end) = rest.find(')') {
                found.push(rest[..end].to_string());
            }
        }
    }
    found
}

#[test]
fn every_relative_link_resolves() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut broken = Vec::new();
    let mut checked = 0;
    for doc in documents(&root) {
        let text = std::fs::read_to_string(&doc).expect("a readable document");
        for target in links(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            checked += 1;
            let (file, fragment) = target.split_once('#').unwrap_or((&target, ""));
            let path = if file.is_empty() {
                doc.clone()
            } else {
                doc.parent().expect("a folder").join(file)
            };
            let ok = match std::fs::read_to_string(&path) {
                Ok(linked) => fragment.is_empty() || anchors(&linked).contains(fragment),
                Err(_) => path.exists() && fragment.is_empty(),
            };
            if !ok {
                broken.push(format!("{}: {target}", doc.display()));
            }
        }
    }
    assert!(
        checked > 20,
        "only {checked} links found: is the parser right?"
    );
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn anchors_follow_githubs_rule() {
    assert_eq!(
        anchor(" Through torch.distributed"),
        "through-torchdistributed"
    );
    assert_eq!(
        anchor("One call, from the entry point"),
        "one-call-from-the-entry-point"
    );
    assert_eq!(anchor("`chorusrun`"), "chorusrun");
}

#[test]
fn the_results_document_is_what_its_rounds_give() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let script = root.join("benches/baselines/regenerate.py");
    let out = match Command::new("python3").arg(&script).arg("--check").output() {
        Ok(out) => out,
        Err(e) => {
            eprintln!("skipping: no python3 to run {} ({e})", script.display());
            return;
        }
    };
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
