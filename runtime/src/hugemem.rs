//! Memory on transparent huge pages, for the bytes the CPU streams every step (the weights).
//!
//! On 4 KiB pages a streaming read crosses a page every 64 cache lines, and the hardware
//! prefetchers stop at each crossing; on 2 MiB pages they run on (the README gives the
//! bandwidth of each, measured), and decode at batch 1 is such a read of all the weights. A file mapping cannot be asked for huge pages (the page cache decides), so the CPU
//! executor reads the weights file into anonymous memory advised `MADV_HUGEPAGE`, aligned to
//! 2 MiB, where the kernel offers transparent huge pages; elsewhere it keeps the file mapping,
//! which costs no copy.

use memmap2::MmapMut;

/// The huge page size on x86-64 and arm64 with 4 KiB base pages.
const HUGE: usize = 2 << 20;

/// Bytes one reader takes at a time in [`HugeBuf::read_file_hashed`]: a few huge pages.
const CHUNK: usize = 8 << 20;

/// Readers of [`HugeBuf::read_file_hashed`] at most (more gain nothing once the memory bus is
/// busy).
pub const READ_THREADS: usize = 4;

/// The buffer's start, shared by the readers, which write disjoint chunks.
struct Base(*mut u8);
// SAFETY: each chunk behind the pointer is written by one thread, read by the hasher only after.
unsafe impl Sync for Base {}

impl Base {
    fn get(&self) -> *mut u8 {
        self.0
    }
}

/// Whether the kernel gives transparent huge pages to memory advised `MADV_HUGEPAGE` (its
/// setting is `always` or `madvise`, not `never`).
pub fn available() -> bool {
    cfg!(target_os = "linux")
        && std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .is_ok_and(|s| !s.contains("[never]"))
}

/// `len` zeroed bytes of anonymous memory starting on a 2 MiB boundary, advised
/// `MADV_HUGEPAGE` (the advice is best effort: where the kernel refuses it the memory is
/// ordinary pages).
pub struct HugeBuf {
    map: MmapMut,
    start: usize,
    len: usize,
}

impl HugeBuf {
    /// Maps the memory (not yet touched: pages come on first write).
    pub fn zeroed(len: usize) -> std::io::Result<HugeBuf> {
        let map = MmapMut::map_anon(len + HUGE)?;
        let start = (map.as_ptr() as usize).next_multiple_of(HUGE) - map.as_ptr() as usize;
        #[cfg(target_os = "linux")]
        if len > 0 {
            let _ = map.advise_range(memmap2::Advice::HugePage, start, len);
        }
        Ok(HugeBuf { map, start, len })
    }

    /// Reads `len` bytes of `file` into new huge-page memory (read, not mapped: the file's
    /// pages are never resident in this process); fails where the file is shorter.
    pub fn read_file(file: &mut std::fs::File, len: usize) -> std::io::Result<HugeBuf> {
        use std::io::Read;
        let mut buf = HugeBuf::zeroed(len)?;
        file.read_exact(buf.as_mut_slice())?;
        Ok(buf)
    }

    /// As [`HugeBuf::read_file`], with the bytes' sha256 (hex), loading as fast as the machine
    /// allows: the read (most of it the kernel zeroing fresh huge pages, then the copy) runs on
    /// all CPUs but one (at least one thread, at most [`READ_THREADS`]), chunk by chunk, while
    /// this thread hashes the chunks already read, in order. Measured on 2 CPUs
    /// (`cargo bench -p maxc-runtime --bench load`), one reader beside the hash beat two
    /// readers contending with it.
    pub fn read_file_hashed(
        file: &std::fs::File,
        len: usize,
    ) -> std::io::Result<(HugeBuf, String)> {
        use sha2::Digest;
        use std::os::unix::fs::FileExt;
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::{mpsc, Mutex};
        let mut buf = HugeBuf::zeroed(len)?;
        let chunks = len.div_ceil(CHUNK);
        let readers = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .saturating_sub(1)
            .clamp(1, READ_THREADS)
            .min(chunks.max(1));
        let base = Base(buf.as_mut_slice().as_mut_ptr());
        let next = AtomicUsize::new(0);
        let failed: Mutex<Option<std::io::Error>> = Mutex::new(None);
        let (done_tx, done_rx) = mpsc::channel::<usize>();
        let mut hasher = sha2::Sha256::new();
        std::thread::scope(|s| {
            for _ in 0..readers {
                let done = done_tx.clone();
                let (next, failed, base) = (&next, &failed, &base);
                s.spawn(move || loop {
                    let c = next.fetch_add(1, Ordering::Relaxed);
                    if c >= chunks {
                        return;
                    }
                    let (from, to) = (c * CHUNK, ((c + 1) * CHUNK).min(len));
                    // SAFETY: chunk `c` is this thread's alone (the counter hands each chunk
                    // out once) and lies inside the buffer; the hasher reads it only after
                    // this thread reports it done.
                    let dst =
                        unsafe { std::slice::from_raw_parts_mut(base.get().add(from), to - from) };
                    if let Err(e) = file.read_exact_at(dst, from as u64) {
                        *failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                        next.store(chunks, Ordering::Relaxed);
                        return;
                    }
                    if done.send(c).is_err() {
                        return;
                    }
                });
            }
            drop(done_tx);
            // Hash the chunks in order as they arrive.
            let mut ready = vec![false; chunks];
            let mut hashed = 0;
            for c in done_rx {
                ready[c] = true;
                while hashed < chunks && ready[hashed] {
                    let (from, to) = (hashed * CHUNK, ((hashed + 1) * CHUNK).min(len));
                    // SAFETY: chunk `hashed` was reported read, and no thread writes it again.
                    hasher.update(unsafe {
                        std::slice::from_raw_parts(base.get().add(from), to - from)
                    });
                    hashed += 1;
                }
            }
        });
        if let Some(e) = failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
            return Err(e);
        }
        let sum = hasher
            .finalize()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        Ok((buf, sum))
    }

    /// As [`HugeBuf::read_file`], with the sha256 (hex) of each `piece` bytes (the last
    /// shorter): every thread this process may run (the caller and [`piece_threads`] - 1
    /// others) takes the next piece, reads it and hashes it, so the hash, the slowest part of a
    /// load, runs on every CPU at once.
    pub fn read_file_piece_hashed(
        file: &std::fs::File,
        len: usize,
        piece: usize,
    ) -> std::io::Result<(HugeBuf, Vec<String>)> {
        let mut buf = HugeBuf::zeroed(len)?;
        let base = Base(buf.as_mut_slice().as_mut_ptr());
        let sums = hash_pieces(len, piece, &|from, to| {
            use std::os::unix::fs::FileExt;
            // SAFETY: each piece is one thread's alone (`hash_pieces` hands each out once)
            // and lies inside the buffer.
            let dst = unsafe { std::slice::from_raw_parts_mut(base.get().add(from), to - from) };
            file.read_exact_at(dst, from as u64)?;
            Ok(&*dst)
        })?;
        Ok((buf, sums))
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.map[self.start..self.start + self.len]
    }

    /// The bytes, to write.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.map[self.start..self.start + self.len]
    }
}

impl std::ops::Deref for HugeBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

/// Threads [`hash_pieces`] runs on: every CPU this process may use, at most 8.
pub fn piece_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, 8)
}

/// The checksum ([`maxc_schema::manifest::piece_digest`], hex) of each `piece` bytes of `len`
/// (the last shorter), `fetch(from, to)`
/// giving the bytes of each (reading them where they are not in memory yet), on
/// [`piece_threads`] threads, the caller one of them, each taking the next piece. The first
/// error stops the others at their next piece.
pub fn hash_pieces<'a>(
    len: usize,
    piece: usize,
    fetch: &(dyn Fn(usize, usize) -> std::io::Result<&'a [u8]> + Sync),
) -> std::io::Result<Vec<String>> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;
    let pieces = len.div_ceil(piece.max(1));
    let next = AtomicUsize::new(0);
    let sums: Mutex<Vec<String>> = Mutex::new(vec![String::new(); pieces]);
    let failed: Mutex<Option<std::io::Error>> = Mutex::new(None);
    let work = || loop {
        let c = next.fetch_add(1, Ordering::Relaxed);
        if c >= pieces {
            return;
        }
        let (from, to) = (c * piece, ((c + 1) * piece).min(len));
        match fetch(from, to) {
            Ok(bytes) => {
                let sum = maxc_schema::manifest::piece_digest(bytes);
                sums.lock().unwrap_or_else(|p| p.into_inner())[c] = sum;
            }
            Err(e) => {
                *failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                next.store(pieces, Ordering::Relaxed);
                return;
            }
        }
    };
    std::thread::scope(|s| {
        for _ in 1..piece_threads().min(pieces.max(1)) {
            s.spawn(work);
        }
        work();
    });
    if let Some(e) = failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    Ok(sums.into_inner().unwrap_or_else(|p| p.into_inner()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every byte and the checksum of each piece of a file of several pieces and a partial
    /// one; a file shorter than asked is an error.
    #[test]
    fn a_piece_hashed_read_keeps_every_byte_and_gives_each_pieces_checksum() {
        let (len, piece) = (3 * 65536 + 777, 65536);
        let data: Vec<u8> = (0..len).map(|i| (i * 7919 % 251) as u8).collect();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w");
        std::fs::write(&path, &data).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        let (buf, sums) = HugeBuf::read_file_piece_hashed(&file, len, piece).unwrap();
        assert_eq!(&buf[..], &data[..]);
        let want: Vec<String> = data
            .chunks(piece)
            .map(maxc_schema::manifest::piece_digest)
            .collect();
        assert_eq!(sums, want);
        assert!(HugeBuf::read_file_piece_hashed(&file, len + 1, piece).is_err());
    }

    /// Every byte and the sha256 of a file of several chunks and a partial one; a file shorter
    /// than asked is an error.
    #[test]
    fn a_hashed_read_keeps_every_byte_and_gives_the_files_sha256() {
        let len = 2 * CHUNK + 12345;
        let data: Vec<u8> = (0..len).map(|i| (i * 131 % 251) as u8).collect();
        let mut f = tempfile::NamedTempFile::new().unwrap();
        std::io::Write::write_all(&mut f, &data).unwrap();
        let (buf, sum) = HugeBuf::read_file_hashed(f.as_file(), len).unwrap();
        assert!(buf.as_slice() == &data[..]);
        assert_eq!(sum, crate::schema::sha256_hex(&data));
        assert!(HugeBuf::read_file_hashed(f.as_file(), len + 1).is_err());
        let (empty, sum) = HugeBuf::read_file_hashed(f.as_file(), 0).unwrap();
        assert!(empty.is_empty() && sum == crate::schema::sha256_hex(&[]));
    }

    #[test]
    fn a_file_read_into_huge_pages_keeps_every_byte_and_the_start_is_2_mib_aligned() {
        let mut tmp = tempfile::NamedTempFile::new().unwrap();
        let bytes: Vec<u8> = (0..(5 << 20) + 123)
            .map(|i| (i * 7 + i / 4099) as u8)
            .collect();
        std::io::Write::write_all(&mut tmp, &bytes).unwrap();
        let mut file = std::fs::File::open(tmp.path()).unwrap();
        let buf = HugeBuf::read_file(&mut file, bytes.len()).unwrap();
        assert_eq!(buf.as_ptr() as usize % HUGE, 0);
        assert!(buf[..] == bytes[..]);
        // A file shorter than asked is an error, not zeros.
        let mut file = std::fs::File::open(tmp.path()).unwrap();
        assert!(HugeBuf::read_file(&mut file, bytes.len() + 1).is_err());
        assert!(HugeBuf::zeroed(0).unwrap().is_empty());
    }
}
