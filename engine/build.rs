//! Rebuilds the crate when a migration is added: `sqlx::migrate!` embeds
//! the `migrations/` directory at compile time, and Cargo does not watch a
//! directory for new files on its own.

fn main() {
    println!("cargo:rerun-if-changed=../migrations");
}
