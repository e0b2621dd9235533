//! The manual against the code: checks that fail when the documentation
//! drifts. The README stays short, every relative link of the README and
//! the manual (`docs/`) leads somewhere, and `docs/configuration.md` names
//! every configuration key of the code, and no key the code lacks.
//!
//! The keys come from the code, not from a list kept here: the settings are
//! loaded the way every service loads them (`Settings::load_with`) from a
//! file that gives every map (`workflows.<name>`, …) one entry and every
//! list of structs (`steps`, `dashboard.tokens`, …) one item, and the field
//! names are read off the settings' derived `Debug`. `Settings` derives
//! `Deserialize` but not `Serialize`, and this crate has no `serde` of its
//! own to walk the `Deserialize` impls with; the derived `Debug` names each
//! field as serde does as long as no configuration struct renames a field
//! (none does: a `#[serde(rename)]` there would need this test changed).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use sas::config::Settings;

/// The longest the README may be: past it, material belongs in `docs/`.
const README_MAX_LINES: usize = 200;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The README, the changelog and every page of `docs/`.
fn manual() -> Vec<PathBuf> {
    let mut files = vec![root().join("README.md"), root().join("CHANGELOG.md")];
    let docs = std::fs::read_dir(root().join("docs")).expect("docs/");
    let mut pages: Vec<PathBuf> = docs
        .map(|e| e.expect("a docs/ entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    pages.sort();
    files.extend(pages);
    files
}

/// The lines of a Markdown text outside fenced code blocks, with their
/// inline code spans removed: what is left is prose, links and headings.
fn prose(text: &str) -> Vec<String> {
    let mut fenced = false;
    let mut lines = Vec::new();
    for line in text.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("```") || trimmed.starts_with("~~~") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            // Odd pieces between backticks are code spans.
            let kept: String = line.split('`').step_by(2).collect();
            lines.push(kept);
        }
    }
    lines
}

/// The targets of the inline links (`[text](target)`) and reference
/// definitions (`[label]: target`) of a Markdown text.
fn link_targets(text: &str) -> Vec<String> {
    let mut targets = Vec::new();
    for line in prose(text) {
        let trimmed = line.trim_start();
        if trimmed.starts_with('[')
            && let Some((label, rest)) = trimmed.split_once("]:")
            && !label.contains('(')
        {
            if let Some(target) = rest.split_whitespace().next() {
                targets.push(target.to_owned());
            }
            continue;
        }
        let mut rest = line.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            // The target ends at the parenthesis that closes the link.
            let mut depth = 0;
            let end = after
                .char_indices()
                .find(|&(_, c)| match c {
                    '(' => {
                        depth += 1;
                        false
                    }
                    ')' if depth == 0 => true,
                    ')' => {
                        depth -= 1;
                        false
                    }
                    _ => false,
                })
                .map_or(after.len(), |(i, _)| i);
            let target = after[..end].trim();
            // A title after the target (`(page.md "title")`) is not part of it.
            let target = target.split_whitespace().next().unwrap_or_default();
            targets.push(target.trim_matches(['<', '>']).to_owned());
            rest = &after[end..];
        }
    }
    targets
}

/// The anchors GitHub makes of a page's headings: lower case, punctuation
/// dropped, spaces as hyphens, and `-1`, `-2` … after a repeated one.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut anchors = BTreeSet::new();
    let mut fenced = false;
    for line in text.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("```") || trimmed.starts_with("~~~") {
            fenced = !fenced;
            continue;
        }
        if fenced || !line.starts_with('#') {
            continue;
        }
        let heading = line.trim_start_matches('#');
        if !heading.starts_with(' ') {
            continue;
        }
        let slug: String = heading
            .trim()
            .trim_end_matches('#')
            .trim()
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let count = seen.entry(slug.clone()).or_insert(0);
        anchors.insert(if *count == 0 {
            slug
        } else {
            format!("{slug}-{count}")
        });
        *count += 1;
    }
    anchors
}

#[test]
fn the_readme_is_at_most_two_hundred_lines() {
    let lines = read(&root().join("README.md")).lines().count();
    assert!(
        lines <= README_MAX_LINES,
        "README.md has {lines} lines, more than {README_MAX_LINES}: move material into docs/"
    );
}

#[test]
fn the_readme_gives_the_test_command_that_ci_runs() {
    // .ci/run runs the README's test command: the two must stay one.
    let ci = read(&root().join(".ci/run"));
    assert!(
        ci.lines().any(|l| l.trim() == "scripts/test.sh"),
        ".ci/run no longer runs scripts/test.sh: update the README's test command"
    );
    let readme = read(&root().join("README.md"));
    assert!(
        readme.lines().any(|l| l.trim() == "scripts/test.sh"),
        "README.md does not give the test command `scripts/test.sh` on a line of its own"
    );
}

/// The fenced block that follows `<!-- first-order: NAME -->` in a text:
/// what `scripts/check-docs.sh` runs against run-local's suite in CI.
fn first_order_block(text: &str, name: &str) -> Option<String> {
    let marker = format!("<!-- first-order: {name} -->");
    let mut lines = text.lines().skip_while(|l| l.trim() != marker).skip(1);
    let fence = lines.find(|l| !l.trim().is_empty())?;
    if !fence.starts_with("```") {
        return None;
    }
    let body: Vec<&str> = lines.take_while(|l| !l.starts_with("```")).collect();
    Some(body.join("\n"))
}

#[test]
fn the_first_orders_a_newcomer_runs_are_marked_for_ci_and_ci_runs_them() {
    let readme = read(&root().join("README.md"));
    for name in ["sasctl", "rust", "python", "http"] {
        assert!(
            first_order_block(&readme, name).is_some_and(|b| !b.trim().is_empty()),
            "README.md has no fenced block marked `<!-- first-order: {name} -->`"
        );
    }
    let started = read(&root().join("docs/getting-started.md"));
    assert!(
        first_order_block(&started, "sasctl").is_some(),
        "docs/getting-started.md's first order is no longer marked `<!-- first-order: sasctl -->`"
    );
    let ci = read(&root().join(".ci/run"));
    assert!(
        ci.lines()
            .any(|l| !l.trim_start().starts_with('#') && l.contains("scripts/check-docs.sh")),
        ".ci/run no longer runs scripts/check-docs.sh, which runs the marked blocks"
    );
}

#[test]
fn the_readmes_rust_first_order_is_the_compiled_example() {
    // CI compiles and runs the example; the README shows it from `use` on.
    let readme = first_order_block(&read(&root().join("README.md")), "rust")
        .expect("README.md's Rust first order");
    let example = read(&root().join("client/examples/first_order.rs"));
    let from_use = example
        .find("\nuse ")
        .map(|at| example[at + 1..].trim_end())
        .expect("client/examples/first_order.rs has a `use`");
    assert_eq!(
        readme.trim_end(),
        from_use,
        "README.md's Rust first order differs from client/examples/first_order.rs: copy the example into the README"
    );
}

#[test]
fn every_relative_link_of_the_readme_and_the_manual_leads_to_a_file_and_heading_that_exist() {
    let mut broken = Vec::new();
    for file in manual() {
        let text = read(&file);
        let dir = file.parent().expect("a file's directory");
        let name = file
            .strip_prefix(root())
            .unwrap_or(&file)
            .display()
            .to_string();
        for target in link_targets(&text) {
            if target.contains("://") || target.starts_with("mailto:") || target.is_empty() {
                continue;
            }
            let (path, anchor) = match target.split_once('#') {
                Some((path, anchor)) => (path, Some(anchor)),
                None => (target.as_str(), None),
            };
            let linked = if path.is_empty() {
                file.clone()
            } else {
                dir.join(path)
            };
            if !linked.exists() {
                broken.push(format!("{name}: {target} (no such file)"));
                continue;
            }
            if let Some(anchor) = anchor
                && linked.extension().is_some_and(|x| x == "md")
                && !anchors(&read(&linked)).contains(anchor)
            {
                broken.push(format!("{name}: {target} (no such heading)"));
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

/// A configuration that gives every map one entry and every list of
/// structs one item, so that the keys inside them show; every `Option` of
/// a struct is set for the same reason. It must pass the services' own
/// checks, since it is loaded as they load theirs.
const EVERY_KIND_OF_KEY: &str = r#"
[workflows.w]
max_failures = 3
retry_schedule = ["1s"]
steps = [
  { name = "s", agent = "a", compensate = "a", after = [], retry = { max_attempts = 2, backoff = "1s", backoff_max = "2s" } },
]

[agents.a]
url = "http://127.0.0.1:1/a"

[schedules.n]
workflow = "w"
cron = "0 2 * * *"

[applications.app]
user = "app"
reply_to = ["app.*"]

[dashboard]
auth = "token"
tokens = [{ name = "t", token = "0123456789abcdef0123", role = "operator" }]
users = [{ name = "u", password = "p" }]
"#;

/// How to read the lines inside what a line of `{:#?}` opens.
enum Opened {
    /// `Name {`: one `field: value` per line.
    Struct,
    /// `{`: one `"key": value` per line, a user-named entry.
    Map,
    /// `[`: one value per line, an item of a list.
    List,
    /// `Some(` or `Name(`: the value inside, at the same path.
    Wrapper,
}

fn opened(value: &str) -> Option<Opened> {
    // In `{:#?}` a line that opens something ends with its bracket; every
    // other value line ends with a comma.
    match value.chars().last()? {
        '{' if value == "{" => Some(Opened::Map),
        '{' => Some(Opened::Struct),
        '[' => Some(Opened::List),
        '(' => Some(Opened::Wrapper),
        _ => None,
    }
}

/// Every struct field's path in `{:#?}` output, dotted, with `<name>` for a
/// map's entry and `[]` for a list's item (`workflows.<name>.steps[].name`),
/// as `docs/configuration.md` writes them.
fn field_paths(debug: &str) -> BTreeSet<String> {
    let mut paths = BTreeSet::new();
    // What each open bracket holds: its path and how to read its lines.
    let mut open: Vec<(String, Opened)> = Vec::new();
    for line in debug.lines() {
        let text = line.trim();
        if text.starts_with(['}', ']', ')']) {
            open.pop();
            continue;
        }
        let (path, value) = match open.last() {
            None => (String::new(), text),
            Some((prefix, Opened::Struct)) => {
                let (field, value) = text
                    .split_once(": ")
                    .unwrap_or_else(|| panic!("not a struct field: {text:?}"));
                let path = if prefix.is_empty() {
                    field.to_owned()
                } else {
                    format!("{prefix}.{field}")
                };
                paths.insert(path.clone());
                (path, value)
            }
            Some((prefix, Opened::Map)) => {
                let (_, value) = text
                    .split_once(": ")
                    .unwrap_or_else(|| panic!("not a map entry: {text:?}"));
                (format!("{prefix}.<name>"), value)
            }
            Some((prefix, Opened::List)) => (format!("{prefix}[]"), text),
            Some((prefix, Opened::Wrapper)) => (prefix.clone(), text),
        };
        if let Some(kind) = opened(value) {
            open.push((path, kind));
        }
    }
    paths
}

/// Every configuration key of the code: the paths of `Settings`' fields.
fn keys_of_the_code() -> BTreeSet<String> {
    let file = std::env::temp_dir().join(format!("sas-docs-{}.toml", uuid::Uuid::new_v4()));
    std::fs::write(&file, EVERY_KIND_OF_KEY).expect("write the configuration");
    // An empty environment: the test's own SAS__* variables must not count.
    let settings = Settings::load_with(Some(&file), Some(Default::default()));
    let _ = std::fs::remove_file(&file);
    let settings = settings.expect("the configuration of every kind of key loads");
    let keys = field_paths(&format!("{settings:#?}"));
    // The walk itself must have seen inside the maps and lists.
    for key in [
        "database.url",
        "workflows.<name>.steps[].retry.max_attempts",
    ] {
        assert!(
            keys.contains(key),
            "{key} not derived from Settings: {keys:?}"
        );
    }
    keys
}

/// Whether `text` names `key` whole: not as part of a longer name
/// (`supervisor.batch` is not in `supervisor.batch_size`).
fn names(text: &str, key: &str) -> bool {
    text.match_indices(key).any(|(at, _)| {
        let before = text[..at].chars().next_back();
        let after = text[at + key.len()..].chars().next();
        !before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '.')
            && !after.is_some_and(|c| c.is_alphanumeric() || c == '_')
    })
}

#[test]
fn every_configuration_key_of_the_code_is_in_the_configuration_page() {
    let page = read(&root().join("docs/configuration.md"));
    let missing: Vec<String> = keys_of_the_code()
        .into_iter()
        .filter(|key| !names(&page, key))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/configuration.md does not name these keys of Settings (give each its default \
         and meaning):\n{}",
        missing.join("\n")
    );
}

#[test]
fn every_key_the_configuration_page_names_is_a_key_of_the_code() {
    let keys = keys_of_the_code();
    let sections: BTreeSet<&str> = keys
        .iter()
        .filter(|k| !k.contains('.'))
        .map(String::as_str)
        .collect();
    let page = read(&root().join("docs/configuration.md"));
    let mut fenced = false;
    let mut unknown = BTreeSet::new();
    for line in page.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        // Code spans are the odd pieces between backticks.
        for span in line.split('`').skip(1).step_by(2) {
            let looks_like_a_key = span.contains('.')
                && span.chars().all(|c| {
                    c.is_ascii_lowercase() || matches!(c, '_' | '.' | '<' | '>' | '[' | ']')
                })
                && span.split('.').next().is_some_and(|s| sections.contains(s));
            if looks_like_a_key && !keys.contains(span) {
                unknown.insert(span.to_owned());
            }
        }
    }
    assert!(
        unknown.is_empty(),
        "docs/configuration.md names keys that Settings does not have:\n{}",
        unknown.into_iter().collect::<Vec<_>>().join("\n")
    );
}
