//! `mpirun -np N comm_check`: runs every collective of the MPI communicator with values that
//! depend on the rank, checks each against its closed form (`comm::self_check`, the same
//! check the in-process group's tests run), and prints a line per rank. Exits non-zero where
//! a check fails. `comm_check hang` has rank 1 skip the barrier, so that the watchdog's
//! timeout (`MAXC_COMM_TIMEOUT_S`, default 60) is seen to end the job.

use maxc_runtime::comm::{self_check, Communicator, MpiComm};
use std::time::Duration;

fn main() {
    let timeout = std::env::var("MAXC_COMM_TIMEOUT_S")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .map(Duration::from_secs_f64)
        .unwrap_or(maxc_runtime::comm::DEFAULT_TIMEOUT);
    let mut comm = match MpiComm::init(timeout) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("comm_check: {e}");
            std::process::exit(2);
        }
    };
    match self_check(&mut comm) {
        Ok(line) => println!("{line}"),
        Err(e) => {
            eprintln!("comm_check: {e}");
            std::process::exit(1);
        }
    }
    if std::env::args().nth(1).as_deref() == Some("hang") {
        if comm.rank() == 1 {
            // Never joins: the others' watchdogs end them, and mpirun the job.
            std::thread::sleep(Duration::from_secs(3600));
        }
        let _ = comm.barrier();
    }
}
