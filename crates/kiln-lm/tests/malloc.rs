//! `kiln_lm::malloc::keep_freed_memory`: a big block freed and allocated again is served from memory the
//! process already has (no page faults), where glibc's default maps it afresh (a fault per page).
//!
//! Its own process with `harness = false`: the allocator setting is process-wide and the measurement
//! counts this thread's page faults, so nothing else may run or allocate beside it.

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn minor_faults() -> i64 {
    // SAFETY: getrusage writes into the zeroed struct we own.
    unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        assert_eq!(libc::getrusage(libc::RUSAGE_THREAD, &mut u), 0);
        u.ru_minflt
    }
}

/// Page faults taken while a block of `n` bytes is allocated and written a second time.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn faults_of_second_use(n: usize) -> i64 {
    let use_block = || {
        let v = std::hint::black_box(vec![1u8; n]);
        drop(v);
    };
    use_block();
    let before = minor_faults();
    use_block();
    minor_faults() - before
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn main() {
    // 48 MiB: above the largest mmap threshold glibc ever picks by itself (32 MiB).
    let n = 48 << 20;
    let pages = (n / 4096) as i64;
    let default = faults_of_second_use(n);
    assert!(
        default > pages / 2,
        "glibc's default should map a 48 MiB block afresh ({default} faults for {pages} pages): the check below would prove nothing"
    );
    assert!(kiln_lm::malloc::keep_freed_memory());
    // The first use after the change may still grow the heap; the second must reuse it.
    let kept = faults_of_second_use(n);
    assert!(
        kept < pages / 20,
        "a freed 48 MiB block should be reused without faults: {kept} faults for {pages} pages (default: {default})"
    );
    // Handing the kept memory back: the next use of the block faults its pages in again.
    assert!(kiln_lm::malloc::release_freed_memory());
    let before = minor_faults();
    drop(std::hint::black_box(vec![1u8; n]));
    let after_release = minor_faults() - before;
    assert!(
        after_release > pages / 2,
        "release_freed_memory should give the 48 MiB back to the kernel: {after_release} faults for {pages} pages on the next use"
    );
    println!(
        "malloc: second use of a 48 MiB block: {default} page faults by default, {kept} with keep_freed_memory, {after_release} after release_freed_memory"
    );
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn main() {
    assert!(!kiln_lm::malloc::keep_freed_memory());
}
