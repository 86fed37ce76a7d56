//! The pool beside one busy process on two CPUs: its width of one leads, the caller pinned to
//! its CPU and the helper to the other, the helper's speculative chunks land in the output, and
//! once the busy process ends the whole width comes back with the threads' CPUs as they were.
//! Its own test binary, so that no other test's threads load the CPUs while it runs.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use maxc_kernels::pool::{self, Spec, SPEC_INPUTS};

mod common;
use common::cpus_allowed_of as cpus_allowed;

/// Some arithmetic: `n` dependent multiply-adds.
fn busy_work(n: u32) -> f64 {
    let mut x = 1.0f64;
    for i in 0..n {
        x = std::hint::black_box(x * 1.000_000_1 + f64::from(i));
    }
    x
}

/// Each output value: its column's input times its row + 1, after some arithmetic.
unsafe fn columns(spec: &Spec, inputs: &[&[u8]; SPEC_INPUTS], out: &mut [f32], cols: Range<usize>) {
    // SAFETY: the inputs are f32.
    let x = unsafe {
        std::slice::from_raw_parts(inputs[0].as_ptr().cast::<f32>(), inputs[0].len() / 4)
    };
    for r in 0..spec.rows {
        for j in cols.clone() {
            std::hint::black_box(busy_work(20));
            out[r * spec.n + j - cols.start] = x[j] * (r + 1) as f32;
        }
    }
}

/// One "step": the width judged between steps, then a speculative job (a decode step's
/// matmul), checked.
fn step(x: &[f32]) {
    pool::between_steps(1);
    let (rows, n) = (2, x.len());
    let mut out = vec![f32::NAN; rows * n];
    let spec = Spec {
        compute: columns,
        inputs: [(x.as_ptr().cast(), x.len() * 4), (std::ptr::null(), 0)],
        data: [0; 4],
        out: out.as_mut_ptr(),
        rows,
        n,
    };
    pool::run_speculative(8, &spec);
    for r in 0..rows {
        for (j, v) in x.iter().enumerate() {
            assert_eq!(out[r * n + j], v * (r + 1) as f32, "row {r} column {j}");
        }
    }
}

fn step_until(x: &[f32], limit: Duration, done: impl Fn() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        step(x);
        if done() {
            return true;
        }
    }
    false
}

/// How one try beside a busy thread ended.
enum Try {
    /// The width of one led: the CPUs of the caller and of the helper while it did, and
    /// whether the helper committed a chunk in 10 s of it.
    Led {
        caller: Vec<usize>,
        helper: Vec<usize>,
        took_part: bool,
    },
    /// The pool paired instead: its thread waited for its CPU, so other processes beside the
    /// busy thread held the CPUs for a while (a build beside the tests), and a pair ends only
    /// when a CPU stands idle.
    Paired,
    /// Neither in 20 s: the width's threads and whether it was paired.
    Neither(usize),
}

/// One try: a busy thread beside the pool until it leads or pairs.
fn beside_a_busy_thread(x: &[f32]) -> Try {
    let stop = Arc::new(AtomicBool::new(false));
    let busy = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                std::hint::spin_loop();
            }
        })
    };
    step_until(x, Duration::from_secs(20), || {
        pool::leading() || pool::paired()
    });
    let result = if pool::leading() {
        let (caller, helper) = (cpus_allowed("thread-self"), cpus_allowed(&helper()));
        let helped = pool::speculation().helped;
        let took_part = step_until(x, Duration::from_secs(10), || {
            pool::speculation().helped > helped
        });
        Try::Led {
            caller,
            helper,
            took_part,
        }
    } else if pool::paired() {
        Try::Paired
    } else {
        Try::Neither(pool::threads())
    };
    stop.store(true, Ordering::Relaxed);
    busy.join().expect("the busy thread");
    result
}

#[test]
fn beside_one_busy_process_the_caller_leads_and_its_helper_takes_chunks() {
    // Leading is on by default (`width.rs`, Leading; `MAXC_LEAD=0` turns it off): this
    // binary's one test makes sure before the pool starts.
    std::env::remove_var("MAXC_LEAD");
    let max = pool::max_threads();
    if max != 2 || !pool::adapts() {
        eprintln!("skipped: {} (leading is for two threads)", pool::choice());
        return;
    }
    // The threads' CPUs before the width first changes (it pins threads only between steps).
    let before = (cpus_allowed("thread-self"), cpus_allowed(&helper()));
    let x: Vec<f32> = (0..2000).map(|i| i as f32 * 0.25).collect();
    let quiet = || !pool::leading() && !pool::paired() && pool::threads() == max;
    let mut paired = 0;
    for _ in 0..3 {
        // From the whole width, unpinned (other processes may have narrowed or paired it).
        if !step_until(&x, Duration::from_secs(10), quiet) {
            eprintln!("the width stayed narrow beside other processes before the busy thread");
            continue;
        }
        match beside_a_busy_thread(&x) {
            Try::Led {
                caller,
                helper: helper_cpus,
                took_part,
            } => {
                assert_eq!(
                    caller.len(),
                    1,
                    "the leading caller may run on CPUs {caller:?}"
                );
                assert!(
                    !helper_cpus.is_empty() && !helper_cpus.contains(&caller[0]),
                    "the helper may run on CPUs {helper_cpus:?}, the caller on {caller:?}"
                );
                assert!(
                    took_part,
                    "the helper committed no chunk in 10 s of leading"
                );
                // The busy thread ended: both threads have a CPU, and the whole width comes
                // back, with the threads' CPUs as they were.
                if step_until(&x, Duration::from_secs(10), quiet) {
                    assert_eq!(
                        (cpus_allowed("thread-self"), cpus_allowed(&helper())),
                        before,
                        "the threads' CPUs after leading"
                    );
                } else {
                    // Other processes may keep this machine's CPUs busy.
                    eprintln!("still leading beside other processes");
                }
                return;
            }
            Try::Paired => paired += 1,
            Try::Neither(threads) => panic!(
                "beside one busy thread the pool neither led nor paired in 20 s \
                 ({threads} thread(s) of {max})"
            ),
        }
    }
    // Every try paired or never found the whole width: other processes kept the CPUs busy,
    // which the pool answers as it should (`pool_width.rs` tests pairing).
    eprintln!("skipped: never led beside other processes ({paired} of 3 tries paired)");
}

/// The pool's first worker's task (`self/task/<tid>`); a worker names itself as it starts, so
/// this waits a while for it.
fn helper() -> String {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(5) {
        for t in std::fs::read_dir("/proc/self/task")
            .expect("tasks")
            .flatten()
        {
            let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
            if comm.trim() == "maxc-cpu-1" {
                return format!("self/task/{}", t.file_name().to_string_lossy());
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("no maxc-cpu-1 thread");
}
