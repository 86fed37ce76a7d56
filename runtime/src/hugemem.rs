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

#[cfg(test)]
mod tests {
    use super::*;

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
