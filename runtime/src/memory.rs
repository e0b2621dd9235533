//! How a service keeps its allocator's memory small.
//!
//! glibc's malloc gives each thread that allocates an arena of its own (up
//! to eight per core) and keeps what each arena once held. A sas service
//! does its work on one thread, beside lapin's I/O thread per broker
//! connection and a few blocking ones, so more arenas only scatter its
//! memory: under 20,000-order bursts the agent's peak RSS was 43.6 to
//! 61.2 MiB with glibc's default (median 52.0, five runs) and 41.5 to 52.1
//! MiB with two arenas (median 44.7), at the same throughput
//! (docs/performance.md, "Memory").

/// Most malloc arenas a service's threads share.
pub const ARENAS: i32 = 2;

/// Limits glibc's malloc to [`ARENAS`] arenas, unless the environment sets
/// `MALLOC_ARENA_MAX` (an operator's choice wins). Call it before the
/// service starts threads: arenas made before stay. Does nothing on other C
/// libraries.
pub fn limit_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
        // SAFETY: `mallopt` only sets a parameter of the allocator, which
        // takes its own lock; it may be called at any time.
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, ARENAS);
        }
    }
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use std::time::Duration;

    const CHILD: &str = "SAS_MEMORY_TEST_CHILD";

    /// The arenas glibc has made so far (the `<heap nr=…>` entries of
    /// `malloc_info`).
    fn arenas() -> usize {
        let path = std::env::temp_dir().join(format!("sas-malloc-info-{}", std::process::id()));
        let c_path = std::ffi::CString::new(path.to_string_lossy().as_bytes()).unwrap();
        // SAFETY: a file opened, written by glibc and closed, all here.
        unsafe {
            let file = libc::fopen(c_path.as_ptr(), c"w".as_ptr());
            assert!(!file.is_null());
            libc::malloc_info(0, file);
            libc::fclose(file);
        }
        let info = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_file(&path).ok();
        info.matches("<heap nr=").count()
    }

    #[test]
    fn threads_that_allocate_share_at_most_two_arenas() {
        // Arenas belong to the process, and the test harness's threads make
        // their own: run in a process of its own.
        if std::env::var_os(CHILD).is_none() {
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "memory::tests::threads_that_allocate_share_at_most_two_arenas",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(CHILD, "1")
                .env_remove("MALLOC_ARENA_MAX")
                .output()
                .unwrap();
            let said = String::from_utf8_lossy(&out.stdout).to_string()
                + &String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{said}");
            assert!(said.contains("1 passed"), "the child ran no test: {said}");
            return;
        }
        super::limit_arenas();
        // Eight threads allocating at once: with glibc's default each would
        // get an arena of its own.
        let threads: Vec<_> = (0..8)
            .map(|i| {
                std::thread::spawn(move || {
                    let held = vec![i as u8; 64 * 1024];
                    std::thread::sleep(Duration::from_millis(100));
                    held.len()
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let n = arenas();
        assert!(n <= super::ARENAS as usize, "{n} arenas");
    }
}
