//! `cargo bench -p maxc-runtime --bench load`: reading an artifact's weights file into huge
//! pages with its sha256 checked, as `Artifact::open` does for the CPU executor: the pipelined
//! parallel read ([`HugeBuf::read_file_hashed`]) against the serial read, then hash, that it
//! replaced, measured in the same run (interleaved rounds, medians) with the ratio. The file is
//! `MAXC_BENCH_FILE` (an artifact's `weights.safetensors`, say), else 512 MiB written here
//! (so in the page cache, as a just-compiled or just-served artifact's is).

use maxc_runtime::hugemem::HugeBuf;
use maxc_runtime::schema::sha256_hex;
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let tmp = tempfile::NamedTempFile::new().expect("a temp file");
    let path = match std::env::var_os("MAXC_BENCH_FILE") {
        Some(p) => std::path::PathBuf::from(p),
        None => {
            let data: Vec<u8> = (0..512usize << 20).map(|i| (i * 131 % 251) as u8).collect();
            std::fs::write(tmp.path(), &data).expect("writes");
            tmp.path().to_path_buf()
        }
    };
    let len = std::fs::metadata(&path).expect("the file").len() as usize;
    let (mut serial, mut piped) = (Vec::new(), Vec::new());
    let mut sums = Vec::new();
    for _ in 0..7 {
        let t = Instant::now();
        let mut f = std::fs::File::open(&path).unwrap();
        let buf = HugeBuf::read_file(&mut f, len).unwrap();
        sums.push(sha256_hex(&buf));
        drop(buf);
        serial.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        let f = std::fs::File::open(&path).unwrap();
        let (buf, sum) = HugeBuf::read_file_hashed(&f, len).unwrap();
        sums.push(sum);
        drop(buf);
        piped.push(t.elapsed().as_secs_f64());
    }
    assert!(
        sums.windows(2).all(|w| w[0] == w[1]),
        "both give one sha256"
    );
    let (s, p) = (median(serial), median(piped));
    println!(
        "{} ({:.0} MiB), {} CPUs: read then hash {:.0} ms, pipelined parallel read and hash {:.0} ms: {:.2}x",
        path.display(),
        len as f64 / (1 << 20) as f64,
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        s * 1e3,
        p * 1e3,
        s / p
    );
}
