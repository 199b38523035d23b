//! The `.wandb` container: a 7-byte W&B header followed by a LevelDB-log record stream.
//!
//! Hand-written: no maintained Rust crate writes the LevelDB *log* format on its own (the LevelDB ports bundle it
//! inside a database engine), and the framing is a few lines. Layout (docs/WANDB.md): blocks of 32768 bytes
//! counted from file offset 0; each chunk is `crc32 u32 LE | length u16 LE | type u8 | payload`, with CRC-32/IEEE
//! (zlib, not CRC32C, not masked) over `type ++ payload`; a record larger than the rest of a block is split into
//! FIRST/MIDDLE.../LAST chunks; a block tail shorter than a chunk header is zero-padded.

use std::io::{self, Write};

/// `:W&B`, version 0xBEE1 (u16 LE), format version 0.
pub const FILE_HEADER: [u8; 7] = [b':', b'W', b'&', b'B', 0xe1, 0xbe, 0x00];
/// LevelDB log block size.
pub const BLOCK_SIZE: usize = 32768;
/// Chunk header: crc (4) + length (2) + type (1).
pub const CHUNK_HEADER: usize = 7;

const FULL: u8 = 1;
const FIRST: u8 = 2;
const MIDDLE: u8 = 3;
const LAST: u8 = 4;

/// Writes records into a LevelDB log stream; each record is handed to the writer in one `write_all` and flushed.
pub struct LogWriter<W: Write> {
    out: W,
    block_offset: usize,
    buf: Vec<u8>,
}

impl<W: Write> LogWriter<W> {
    /// Start a new file: writes the W&B header.
    pub fn new(mut out: W) -> io::Result<LogWriter<W>> {
        out.write_all(&FILE_HEADER)?;
        out.flush()?;
        Ok(LogWriter {
            out,
            block_offset: FILE_HEADER.len(),
            buf: Vec::new(),
        })
    }

    /// Append one record (split into chunks as needed) and flush it.
    pub fn add_record(&mut self, data: &[u8]) -> io::Result<()> {
        self.buf.clear();
        let mut left = data;
        let mut begin = true;
        loop {
            let leftover = BLOCK_SIZE - self.block_offset;
            if leftover < CHUNK_HEADER {
                self.buf.extend(std::iter::repeat_n(0u8, leftover));
                self.block_offset = 0;
            }
            let avail = BLOCK_SIZE - self.block_offset - CHUNK_HEADER;
            let n = left.len().min(avail);
            let end = n == left.len();
            let kind = match (begin, end) {
                (true, true) => FULL,
                (true, false) => FIRST,
                (false, false) => MIDDLE,
                (false, true) => LAST,
            };
            let payload = &left[..n];
            let mut h = crc32fast::Hasher::new();
            h.update(&[kind]);
            h.update(payload);
            self.buf.extend_from_slice(&h.finalize().to_le_bytes());
            self.buf.extend_from_slice(&(n as u16).to_le_bytes());
            self.buf.push(kind);
            self.buf.extend_from_slice(payload);
            self.block_offset += CHUNK_HEADER + n;
            left = &left[n..];
            begin = false;
            if end {
                break;
            }
        }
        self.out.write_all(&self.buf)?;
        self.out.flush()
    }

    /// The underlying writer.
    pub fn get_mut(&mut self) -> &mut W {
        &mut self.out
    }
}

/// Read every record back (for tests and tools). Stops with an error at the first corrupt chunk.
pub fn read_records(bytes: &[u8]) -> Result<Vec<Vec<u8>>, String> {
    let (records, err) = read_records_lenient(bytes);
    match err {
        Some(e) => Err(e),
        None => Ok(records),
    }
}

/// Read the records up to the first corrupt or truncated chunk (e.g. the tail a crash left), and that error.
pub fn read_records_lenient(bytes: &[u8]) -> (Vec<Vec<u8>>, Option<String>) {
    let mut out = Vec::new();
    let err = read_into(bytes, &mut out).err();
    (out, err)
}

fn read_into(bytes: &[u8], out: &mut Vec<Vec<u8>>) -> Result<(), String> {
    if bytes.len() < FILE_HEADER.len() || bytes[..FILE_HEADER.len()] != FILE_HEADER {
        return Err("not a .wandb file (bad header)".into());
    }
    let mut pos = FILE_HEADER.len();
    let mut cur: Option<Vec<u8>> = None;
    while pos < bytes.len() {
        let left_in_block = BLOCK_SIZE - pos % BLOCK_SIZE;
        if left_in_block < CHUNK_HEADER {
            pos += left_in_block;
            continue;
        }
        if pos + CHUNK_HEADER > bytes.len() {
            return Err(format!("truncated chunk header at offset {pos}"));
        }
        let crc = u32::from_le_bytes(bytes[pos..pos + 4].try_into().unwrap_or_default());
        let len = u16::from_le_bytes([bytes[pos + 4], bytes[pos + 5]]) as usize;
        let kind = bytes[pos + 6];
        let start = pos + CHUNK_HEADER;
        if start + len > bytes.len() || CHUNK_HEADER + len > left_in_block {
            return Err(format!(
                "chunk at offset {pos} overruns its block or the file"
            ));
        }
        let payload = &bytes[start..start + len];
        let mut h = crc32fast::Hasher::new();
        h.update(&[kind]);
        h.update(payload);
        if h.finalize() != crc {
            return Err(format!("CRC mismatch at offset {pos}"));
        }
        match kind {
            FULL => out.push(payload.to_vec()),
            FIRST => cur = Some(payload.to_vec()),
            MIDDLE | LAST => {
                let c = cur
                    .as_mut()
                    .ok_or_else(|| format!("orphan chunk at offset {pos}"))?;
                c.extend_from_slice(payload);
                if kind == LAST {
                    out.extend(cur.take());
                }
            }
            _ => return Err(format!("unknown chunk type {kind} at offset {pos}")),
        }
        pos = start + len;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_never_cross_blocks_and_round_trip() {
        let mut w = LogWriter::new(Vec::new()).unwrap();
        let mut recs = Vec::new();
        // sizes chosen to hit: exact fills, a tail < 7 bytes (padding), and a record spanning 4 blocks
        for (i, n) in [
            10usize,
            32768 - 7 - 7 - 10 - 7 - 3,
            5,
            100_000,
            0,
            1234,
            32761,
        ]
        .iter()
        .enumerate()
        {
            let r: Vec<u8> = (0..*n).map(|j| (i * 31 + j) as u8).collect();
            w.add_record(&r).unwrap();
            recs.push(r);
        }
        let bytes = w.get_mut().clone();
        assert_eq!(&bytes[..7], &[0x3a, 0x57, 0x26, 0x42, 0xe1, 0xbe, 0x00]);
        assert_eq!(read_records(&bytes).unwrap(), recs);
    }

    #[test]
    fn known_crc() {
        // CRC-32/IEEE of [1] ++ "abc"
        let mut w = LogWriter::new(Vec::new()).unwrap();
        w.add_record(b"abc").unwrap();
        let b = w.get_mut().clone();
        assert_eq!(
            u32::from_le_bytes(b[7..11].try_into().unwrap()),
            crc32fast::hash(b"\x01abc")
        );
        assert_eq!(&b[11..14], &[3, 0, 1]);
    }
}
