//! Static checks of what users build and run but this machine cannot (no
//! Docker engine): the image's build context holds every workspace member, and
//! compose runs programs the workspace builds.

use std::path::Path;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
}

fn read(file: &str) -> String {
    std::fs::read_to_string(root().join(file)).unwrap_or_else(|e| panic!("{file}: {e}"))
}

/// The workspace members' paths (`services/agent`, `core`, …), from the
/// root Cargo.toml.
fn members() -> Vec<String> {
    let manifest = read("Cargo.toml");
    let start = manifest.find("members = [").expect("members list");
    let end = start + manifest[start..].find(']').expect("end of members");
    manifest[start..end]
        .split('"')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

/// The workspace members' top-level directories.
fn member_dirs() -> Vec<String> {
    let mut dirs: Vec<String> = members()
        .iter()
        .map(|m| m.split('/').next().unwrap_or(m).to_owned())
        .collect();
    dirs.sort();
    dirs.dedup();
    dirs
}

#[test]
fn the_dockerfile_copies_every_workspace_member_and_the_migrations() {
    let dockerfile = read("Dockerfile");
    let copied = |dir: &str| {
        dockerfile
            .lines()
            .any(|l| l.trim_start().starts_with("COPY") && l.split_whitespace().nth(1) == Some(dir))
    };
    for dir in member_dirs()
        .iter()
        .map(String::as_str)
        .chain(["migrations"])
    {
        assert!(
            copied(dir),
            "Dockerfile does not COPY {dir}: `cargo build --locked` of the workspace would fail"
        );
    }
}

#[test]
fn compose_runs_only_programs_the_workspace_builds() {
    let compose = read("docker-compose.yml");
    let programs = [
        "submission",
        "scheduler",
        "agent",
        "supervisor",
        "dashboard",
        "sasctl",
        "remote-sim",
    ];
    for dir in programs {
        assert!(
            root()
                .join("services")
                .join(dir)
                .join("src/main.rs")
                .exists(),
            "{dir}"
        );
    }
    for line in compose
        .lines()
        .filter(|l| l.trim_start().starts_with("command:"))
    {
        let first = line
            .split_once("command:")
            .map(|(_, c)| c.trim().trim_start_matches('[').trim_start_matches('"'))
            .and_then(|c| {
                c.split(|ch: char| ch == '"' || ch.is_whitespace() || ch == ',')
                    .next()
            })
            .unwrap_or_default()
            .to_owned();
        // Multi-line commands belong to other images (Prometheus' flags).
        if first.is_empty() {
            continue;
        }
        let known = programs.contains(&first.as_str()) || first.ends_with(".sh");
        assert!(
            known,
            "compose runs {first:?}, which the image does not have: {line}"
        );
    }
}

#[test]
fn the_shipped_configurations_load_and_pass_every_check() {
    for file in [
        "config/local.toml",
        "config/demo.toml",
        "deploy/kubernetes/base/sas.toml",
    ] {
        let path = root().join(file);
        // Only the file's own layers: no SAS__* variable of this process.
        let settings = sas::config::Settings::load_with(Some(&path), Some(Default::default()))
            .unwrap_or_else(|e| panic!("{file}: {e}"));
        // What every service checks at start-up.
        settings
            .validate()
            .unwrap_or_else(|e| panic!("{file}: {e}"));
        for name in settings.workflows.keys() {
            settings
                .workflow(name)
                .unwrap_or_else(|e| panic!("{file}: {e}"));
        }
        for name in settings.schedules.keys() {
            settings
                .schedule(name, chrono::Utc::now())
                .unwrap_or_else(|e| panic!("{file}: {e}"));
        }
    }
}

#[test]
fn the_image_builds_only_the_binaries_it_installs_and_bakes_in_no_configuration() {
    let dockerfile = read("Dockerfile");
    // The words of the `cargo build` command, up to its `;`.
    let build = dockerfile
        .split_once("cargo build")
        .and_then(|(_, rest)| rest.split_once(';'))
        .map(|(build, _)| build)
        .expect("a cargo build");
    let built: std::collections::BTreeSet<&str> = build
        .split_whitespace()
        .collect::<Vec<_>>()
        .windows(2)
        .filter(|w| w[0] == "-p")
        .map(|w| w[1])
        .collect();
    let installed: std::collections::BTreeSet<&str> = dockerfile
        .lines()
        .find_map(|l| l.trim_start().strip_prefix("for bin in "))
        .and_then(|l| l.split_once("; do"))
        .map(|(bins, _)| bins.split_whitespace().collect())
        .expect("the install loop");
    assert_eq!(built, installed, "the test and bench crates are not built");
    assert!(
        !dockerfile.contains("--workspace"),
        "builds the whole workspace"
    );
    assert!(
        !dockerfile.lines().any(|l| l.starts_with("COPY config")),
        "configuration baked into the image"
    );
    let compose = read("docker-compose.yml");
    assert!(
        compose.contains("./config:/etc/sas:ro"),
        "compose mounts the configuration"
    );
}

/// The crates of sas's server side, above the core.
const SERVER: [&str; 4] = ["sas-store", "sas-broker", "sas-runtime", "sas-engine"];

#[test]
fn the_core_crate_does_no_io_and_knows_no_runtime() {
    // The layers: sas-core decides, the engine (sas-engine) loads, writes
    // back and talks to the broker around it. The compiler holds the line
    // through this.
    let io = [
        "tokio",
        "sqlx",
        "sqlx-core",
        "sqlx-postgres",
        "lapin",
        "reqwest",
        "hyper",
        "axum",
    ];
    sas_tests::assert_layer("sas-core", &["sas-protocol"], &[&io[..], &SERVER].concat());
}

#[test]
fn the_store_knows_no_broker() {
    // sas-store is SQL verbs over sas-core's types: it never reaches RabbitMQ.
    let broker = ["lapin", "amq-protocol", "sas-client"];
    let above = ["sas-broker", "sas-runtime", "sas-engine"];
    sas_tests::assert_layer("sas-store", &["sqlx"], &[&broker[..], &above].concat());
}

#[test]
fn the_broker_knows_no_sql() {
    // sas-broker is lapin and dead letters: it never reaches Postgres.
    let sql = ["sqlx", "sqlx-core", "sqlx-postgres"];
    let others = ["sas-store", "sas-runtime", "sas-engine"];
    sas_tests::assert_layer("sas-broker", &["lapin"], &[&sql[..], &others].concat());
}

#[test]
fn no_service_hands_a_value_between_its_parts_through_a_once_lock() {
    // A service is built as a value: what its routes and its work share is
    // passed, not parked in a slot that one fills and the other reads.
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut wiring = vec![root.join("runtime/src/service.rs")];
    for service in std::fs::read_dir(root.join("services")).expect("services") {
        let src = service.expect("service").path().join("src");
        wiring.extend([src.join("main.rs"), src.join("lib.rs")]);
    }
    for file in wiring.iter().filter(|f| f.exists()) {
        let text = std::fs::read_to_string(file).expect("source");
        assert!(
            !text.contains("OnceLock"),
            "{} parks a value in a OnceLock",
            file.display()
        );
    }
    let read = wiring.iter().filter(|f| f.exists()).count();
    assert!(read > 10, "{wiring:?}");
}

/// The code lines of the `.rs` files under `dir` (comments left out), with
/// their file's name.
fn code_lines(dir: &std::path::Path) -> Vec<(String, String)> {
    let mut lines = Vec::new();
    for entry in std::fs::read_dir(dir).expect("source directory") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            lines.extend(code_lines(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&path).expect("source");
            for line in text.lines() {
                let code = line.split("//").next().unwrap_or_default();
                if !code.trim().is_empty() {
                    lines.push((path.display().to_string(), code.to_owned()));
                }
            }
        }
    }
    lines
}

#[test]
fn the_store_holds_no_rule_and_never_learns_whether_a_relay_is_ready() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../store/src");
    let lines = code_lines(&root);
    assert!(lines.len() > 1000, "read the store's sources");
    // The rules' types may pass through the store (it maps rows to them);
    // their functions are the engine's to call. A path into the rules ends
    // in a type (UpperCamel), or a group of them.
    for (file, line) in &lines {
        for (at, _) in line.match_indices("rules::") {
            let rest = &line[at + "rules::".len()..];
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
                .unwrap_or(rest.len());
            let (path, after) = rest.split_at(end);
            let named: Vec<&str> = match after.strip_prefix('{') {
                Some(group) => group
                    .split('}')
                    .next()
                    .unwrap_or_default()
                    .split(',')
                    .collect(),
                None => vec![
                    path.trim_end_matches(':')
                        .rsplit("::")
                        .next()
                        .unwrap_or_default(),
                ],
            };
            for name in named.iter().map(|n| n.trim()).filter(|n| !n.is_empty()) {
                assert!(
                    name.starts_with(|c: char| c.is_ascii_uppercase()) || name == "self",
                    "{file} calls into the rules ({name}): {line}"
                );
            }
        }
        for word in ["hand_over", "ready(", "Relay", "Outlet"] {
            assert!(!line.contains(word), "{file} knows the relay: {line}");
        }
    }
}

#[test]
fn every_crates_docs_name_each_of_its_modules() {
    // A reader starts at the crate's docs: each module is named there, with
    // what it is for, so none is found only by reading the code.
    let mut read_libs = 0;
    for member in members() {
        let Ok(text) = std::fs::read_to_string(root().join(&member).join("src/lib.rs")) else {
            continue;
        };
        read_libs += 1;
        let doc: std::collections::BTreeSet<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("//!"))
            .flat_map(|l| l.split(|c: char| !(c.is_alphanumeric() || c == '_')))
            .collect();
        for line in text.lines() {
            let declared = line
                .trim_start_matches("pub ")
                .trim_start_matches("pub(crate) ")
                .strip_prefix("mod ")
                .and_then(|rest| rest.split([';', ' ']).next());
            if let Some(module) = declared.filter(|m| *m != "tests") {
                assert!(
                    doc.contains(module),
                    "{member}/src/lib.rs: the crate's docs do not name module `{module}`"
                );
            }
        }
    }
    assert!(read_libs >= 15, "{read_libs} libraries read");
}
