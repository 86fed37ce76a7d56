//! What the pool's integration tests read of Linux's task files.

/// The CPUs a task may run on (`Cpus_allowed_list` of `/proc/<task>/status`; `task` e.g.
/// `thread-self` or `self/task/<tid>`).
pub fn cpus_allowed_of(task: &str) -> Vec<usize> {
    let status = std::fs::read_to_string(format!("/proc/{task}/status")).expect("its status");
    let list = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .expect("Cpus_allowed_list");
    let mut cpus = Vec::new();
    for part in list.trim().split(',') {
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        cpus.extend(lo.trim().parse::<usize>().expect("a CPU")..=hi.trim().parse().expect("a CPU"));
    }
    cpus
}
