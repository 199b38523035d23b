//! GGUF model files (llama.cpp's format): metadata, tensors dequantised to f32 (F32, F16, BF16,
//! Q4_0, Q4_1, Q8_0, Q4_K, Q6_K), the model config, and the embedded tokenizer vocabulary.
//!
//! Hand-written on purpose: the maintained Rust GGUF reader is `candle-core`'s `gguf_file`,
//! which would pull a second tensor library into the build for a ~300-line job (the format
//! is a small, versioned, little-endian container and the block layouts below are fixed by
//! ggml). Dequantisation is checked against the `gguf` Python package in the tests.
//!
//! **No panic, no unbounded allocation.** A GGUF file is untrusted input. Every read is
//! bounds-checked; every count and size read from the header is checked, in checked
//! arithmetic, against the file's real length before anything is allocated for it (a count of
//! items can be no larger than the bytes left; metadata holds at most [`MAX_METADATA_VALUES`]
//! values); every tensor's extent (dims x block size, at its offset) must lie inside the file
//! and no two tensors may overlap, so the f32 data a file can yield is bounded by its length;
//! the model config is held to the ceilings of [`crate::config::limits`]. A truncated,
//! corrupt or forged file is an error naming the file and what was wrong, never a panic
//! (`tests/untrusted_files.rs` fuzzes this).

use std::collections::HashMap;
use std::path::Path;

use crate::config::{TokenIds, TransformerConfig};
use crate::weights::{TensorSource, WeightsError};

/// Most metadata values (array elements included) a GGUF file may hold: far above a real
/// tokenizer's (Gemma: 256k tokens x 3 arrays), and a bound on the memory metadata can take.
pub const MAX_METADATA_VALUES: usize = 1 << 22;

/// Largest `general.alignment` accepted (llama.cpp writes 32).
const MAX_ALIGNMENT: u64 = 1 << 20;

/// A GGUF metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    /// Any unsigned integer type.
    U64(u64),
    /// Any signed integer type.
    I64(i64),
    /// f32 or f64.
    F64(f64),
    /// bool.
    Bool(bool),
    /// UTF-8 string (invalid UTF-8 is replaced).
    Str(String),
    /// Array of values.
    Array(Vec<GgufValue>),
}

impl GgufValue {
    /// As an unsigned integer, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match self {
            GgufValue::U64(v) => Some(*v),
            GgufValue::I64(v) if *v >= 0 => Some(*v as u64),
            _ => None,
        }
    }
    /// As a float, if numeric.
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            GgufValue::F64(v) => Some(*v),
            GgufValue::U64(v) => Some(*v as f64),
            GgufValue::I64(v) => Some(*v as f64),
            _ => None,
        }
    }
    /// As a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::Str(s) => Some(s),
            _ => None,
        }
    }
    /// As a bool.
    pub fn as_bool(&self) -> Option<bool> {
        match self {
            GgufValue::Bool(b) => Some(*b),
            _ => None,
        }
    }
}

/// ggml tensor element types kiln can dequantise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlType {
    /// 32-bit float.
    F32,
    /// 16-bit float.
    F16,
    /// bfloat16.
    BF16,
    /// 4-bit, blocks of 32, scale.
    Q4_0,
    /// 4-bit, blocks of 32, scale + min.
    Q4_1,
    /// 8-bit, blocks of 32, scale.
    Q8_0,
    /// 4-bit k-quant, super-blocks of 256.
    Q4K,
    /// 6-bit k-quant, super-blocks of 256.
    Q6K,
}

impl GgmlType {
    fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            8 => GgmlType::Q8_0,
            12 => GgmlType::Q4K,
            14 => GgmlType::Q6K,
            30 => GgmlType::BF16,
            _ => return None,
        })
    }

    /// (elements per block, bytes per block).
    fn block(self) -> (usize, usize) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::BF16 => (1, 2),
            GgmlType::Q4_0 => (32, 18),
            GgmlType::Q4_1 => (32, 20),
            GgmlType::Q8_0 => (32, 34),
            GgmlType::Q4K => (256, 144),
            GgmlType::Q6K => (256, 210),
        }
    }
}

/// One tensor's directory entry.
#[derive(Clone, Debug)]
pub struct GgufTensorInfo {
    /// ggml dims, innermost first (a `[out, in]` matrix is `[in, out]` here).
    pub dims: Vec<usize>,
    /// Element type id (raw, so unsupported types can be reported by name).
    pub type_id: u32,
    /// Byte offset into the data section.
    pub offset: usize,
}

/// An opened GGUF file (memory-mapped).
pub struct GgufFile {
    path: String,
    mmap: memmap2::Mmap,
    /// Metadata key/values.
    pub metadata: HashMap<String, GgufValue>,
    /// Tensor directory by name.
    pub tensors: HashMap<String, GgufTensorInfo>,
    data_start: usize,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a str,
    /// Metadata values still allowed (see [`MAX_METADATA_VALUES`]).
    values_left: usize,
}

impl<'a> Cursor<'a> {
    fn err(&self, what: &str) -> WeightsError {
        WeightsError::Gguf {
            path: self.path.into(),
            message: format!(
                "{what} at byte {} (file is {} bytes): truncated or corrupt; download it again",
                self.pos,
                self.buf.len()
            ),
        }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], WeightsError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| self.err("unexpected end of file"))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32, WeightsError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    fn u64(&mut self) -> Result<u64, WeightsError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
    fn len(&mut self) -> Result<usize, WeightsError> {
        let n = self.u64()?;
        // Every element takes at least one byte: a larger count is corrupt.
        if n > (self.buf.len() - self.pos) as u64 {
            return Err(self.err("length larger than the file"));
        }
        Ok(n as usize)
    }
    fn string(&mut self) -> Result<String, WeightsError> {
        let n = self.len()?;
        Ok(String::from_utf8_lossy(self.take(n)?).into_owned())
    }
    fn value(&mut self, ty: u32, depth: usize) -> Result<GgufValue, WeightsError> {
        self.values_left = self
            .values_left
            .checked_sub(1)
            .ok_or_else(|| self.err("more metadata values than a model file has"))?;
        Ok(match ty {
            0 => GgufValue::U64(self.take(1)?[0] as u64),
            1 => GgufValue::I64(self.take(1)?[0] as i8 as i64),
            2 => GgufValue::U64(u16::from_le_bytes(self.take(2)?.try_into().expect("2")) as u64),
            3 => GgufValue::I64(i16::from_le_bytes(self.take(2)?.try_into().expect("2")) as i64),
            4 => GgufValue::U64(self.u32()? as u64),
            5 => GgufValue::I64(self.u32()? as i32 as i64),
            6 => GgufValue::F64(f32::from_le_bytes(self.take(4)?.try_into().expect("4")) as f64),
            7 => GgufValue::Bool(self.take(1)?[0] != 0),
            8 => GgufValue::Str(self.string()?),
            9 => {
                if depth > 2 {
                    return Err(self.err("arrays nested too deeply"));
                }
                let ety = self.u32()?;
                let n = self.len()?;
                let mut v = Vec::with_capacity(n.min(1 << 20));
                for _ in 0..n {
                    v.push(self.value(ety, depth + 1)?);
                }
                GgufValue::Array(v)
            }
            10 => GgufValue::U64(self.u64()?),
            11 => GgufValue::I64(self.u64()? as i64),
            12 => GgufValue::F64(f64::from_le_bytes(self.take(8)?.try_into().expect("8"))),
            other => return Err(self.err(&format!("unknown metadata value type {other}"))),
        })
    }
}

fn ggml_type_name(id: u32) -> String {
    match id {
        6 => "Q5_0".into(),
        7 => "Q5_1".into(),
        9 => "Q8_1".into(),
        10 => "Q2_K".into(),
        11 => "Q3_K".into(),
        13 => "Q5_K".into(),
        15 => "Q8_K".into(),
        other => format!("ggml type {other}"),
    }
}

fn f16(b: &[u8]) -> f32 {
    half::f16::from_le_bytes([b[0], b[1]]).to_f32()
}

fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Dequantise `n` elements of type `ty` from `data` (which must hold exactly the blocks).
/// Never yields more elements than `data` holds, whatever `n` says.
pub fn dequantize(ty: GgmlType, data: &[u8], n: usize) -> Vec<f32> {
    let (be, bs) = ty.block();
    let mut out = Vec::with_capacity(n.min(data.len() / bs * be));
    match ty {
        GgmlType::F32 => out.extend(
            data.chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        ),
        GgmlType::F16 => out.extend(data.chunks_exact(2).map(f16)),
        GgmlType::BF16 => out.extend(
            data.chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()),
        ),
        GgmlType::Q4_0 => {
            for b in data.chunks_exact(bs) {
                let d = f16(&b[0..2]);
                let qs = &b[2..18];
                out.extend(qs.iter().map(|&q| ((q & 0xF) as i32 - 8) as f32 * d));
                out.extend(qs.iter().map(|&q| ((q >> 4) as i32 - 8) as f32 * d));
            }
        }
        GgmlType::Q4_1 => {
            for b in data.chunks_exact(bs) {
                let (d, m) = (f16(&b[0..2]), f16(&b[2..4]));
                let qs = &b[4..20];
                out.extend(qs.iter().map(|&q| (q & 0xF) as f32 * d + m));
                out.extend(qs.iter().map(|&q| (q >> 4) as f32 * d + m));
            }
        }
        GgmlType::Q8_0 => {
            for b in data.chunks_exact(bs) {
                let d = f16(&b[0..2]);
                out.extend(b[2..34].iter().map(|&q| (q as i8) as f32 * d));
            }
        }
        GgmlType::Q4K => {
            for b in data.chunks_exact(bs) {
                let (d, dmin) = (f16(&b[0..2]), f16(&b[2..4]));
                let scales = &b[4..16];
                let qs = &b[16..144];
                for (k, q) in qs.chunks_exact(32).enumerate() {
                    let (sc1, m1) = scale_min_k4(2 * k, scales);
                    let (sc2, m2) = scale_min_k4(2 * k + 1, scales);
                    let (d1, mm1) = (d * sc1 as f32, dmin * m1 as f32);
                    let (d2, mm2) = (d * sc2 as f32, dmin * m2 as f32);
                    out.extend(q.iter().map(|&x| d1 * (x & 0xF) as f32 - mm1));
                    out.extend(q.iter().map(|&x| d2 * (x >> 4) as f32 - mm2));
                }
            }
        }
        GgmlType::Q6K => {
            for b in data.chunks_exact(bs) {
                let ql = &b[0..128];
                let qh = &b[128..192];
                let sc = &b[192..208];
                let d = f16(&b[208..210]);
                for half_ in 0..2 {
                    let ql = &ql[64 * half_..64 * half_ + 64];
                    let qh = &qh[32 * half_..32 * half_ + 32];
                    let sc = &sc[8 * half_..8 * half_ + 8];
                    let mut y = [0f32; 128];
                    for l in 0..32 {
                        let is = l / 16;
                        let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                        let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                        let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                        let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                        y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                        y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                        y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                        y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                    }
                    out.extend_from_slice(&y);
                }
            }
        }
    }
    out.truncate(n);
    out
}

impl GgufFile {
    /// Open and parse the header, metadata and tensor directory of a GGUF file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, WeightsError> {
        let path = path.as_ref();
        let p = path.display().to_string();
        let f = std::fs::File::open(path).map_err(|source| WeightsError::Io {
            path: p.clone(),
            source,
        })?;
        // SAFETY: read-only map kept alive by `self`.
        let mmap = unsafe { memmap2::Mmap::map(&f) }.map_err(|source| WeightsError::Io {
            path: p.clone(),
            source,
        })?;
        let (metadata, tensors, data_start) = Self::parse(&mmap, &p)?;
        Ok(Self {
            path: p,
            mmap,
            metadata,
            tensors,
            data_start,
        })
    }

    #[allow(clippy::type_complexity)]
    fn parse(
        buf: &[u8],
        path: &str,
    ) -> Result<
        (
            HashMap<String, GgufValue>,
            HashMap<String, GgufTensorInfo>,
            usize,
        ),
        WeightsError,
    > {
        let mut c = Cursor {
            buf,
            pos: 0,
            path,
            values_left: MAX_METADATA_VALUES,
        };
        if c.take(4).map_err(|_| c.err("missing GGUF magic"))? != b"GGUF" {
            return Err(WeightsError::Gguf {
                path: path.into(),
                message: "not a GGUF file (bad magic)".into(),
            });
        }
        let version = c.u32()?;
        if !(2..=3).contains(&version) {
            return Err(WeightsError::Gguf {
                path: path.into(),
                message: format!("GGUF version {version} is not supported (2 or 3)"),
            });
        }
        let n_tensors = c.len()?;
        let n_kv = c.len()?;
        let mut metadata = HashMap::new();
        for _ in 0..n_kv {
            let k = c.string()?;
            let ty = c.u32()?;
            let v = c.value(ty, 0)?;
            metadata.insert(k, v);
        }
        let mut tensors = HashMap::new();
        for _ in 0..n_tensors {
            let name = c.string()?;
            let nd = c.u32()? as usize;
            if nd > 4 {
                return Err(c.err("tensor with more than 4 dims"));
            }
            let mut dims = Vec::with_capacity(nd);
            for _ in 0..nd {
                let d = c.u64()?;
                dims.push(
                    usize::try_from(d).map_err(|_| c.err(&format!("tensor `{name}` dim {d}")))?,
                );
            }
            let type_id = c.u32()?;
            let offset = c.u64()?;
            let offset = usize::try_from(offset)
                .map_err(|_| c.err(&format!("tensor `{name}` offset {offset}")))?;
            if tensors.contains_key(&name) {
                return Err(c.err(&format!("tensor `{name}` listed twice")));
            }
            tensors.insert(
                name,
                GgufTensorInfo {
                    dims,
                    type_id,
                    offset,
                },
            );
        }
        let align = match metadata.get("general.alignment") {
            None => 32,
            Some(v) => match v.as_u64() {
                Some(a) if (1..=MAX_ALIGNMENT).contains(&a) => a as usize,
                _ => {
                    return Err(WeightsError::Gguf {
                        path: path.into(),
                        message: format!(
                            "general.alignment {v:?} is not an integer in 1..={MAX_ALIGNMENT}: corrupt file"
                        ),
                    });
                }
            },
        };
        // `pos` < the file length, `align` <= 2^20: no overflow.
        let data_start = c.pos.div_ceil(align) * align;
        // Every tensor of a known type must lie inside the file, and no two may overlap: then
        // the f32 data the file can yield is bounded by its length.
        let mut extents: Vec<(usize, usize, &str)> = Vec::with_capacity(tensors.len());
        for (name, info) in &tensors {
            if let Some(e) = Self::extent(path, buf.len(), data_start, name, info)?
                && e.end > e.start
            {
                extents.push((e.start, e.end, name));
            }
        }
        extents.sort_unstable();
        for w in extents.windows(2) {
            if w[1].0 < w[0].1 {
                return Err(WeightsError::Gguf {
                    path: path.into(),
                    message: format!(
                        "tensors `{}` and `{}` overlap (bytes {}..{} and {}..{}): corrupt file; download it again",
                        w[0].2, w[1].2, w[0].0, w[0].1, w[1].0, w[1].1
                    ),
                });
            }
        }
        Ok((metadata, tensors, data_start))
    }

    /// Where tensor `name`'s data lies in a file of `file_len` bytes, computed in checked
    /// arithmetic and checked against the file: `None` for a type kiln cannot read (an error
    /// only when that tensor is read).
    fn extent(
        path: &str,
        file_len: usize,
        data_start: usize,
        name: &str,
        info: &GgufTensorInfo,
    ) -> Result<Option<Extent>, WeightsError> {
        let bad = |message: String| WeightsError::Gguf {
            path: path.into(),
            message,
        };
        let Some(ty) = GgmlType::from_id(info.type_id) else {
            return Ok(None);
        };
        let (be, bs) = ty.block();
        let inner = info.dims.first().copied().unwrap_or(1);
        if !inner.is_multiple_of(be) {
            return Err(bad(format!(
                "tensor `{name}`: row of {inner} is not a multiple of {be}"
            )));
        }
        let absurd = || {
            bad(format!(
                "tensor `{name}` has an absurd shape {:?}",
                info.dims
            ))
        };
        let n = info
            .dims
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(absurd)?;
        let nbytes = (n / be).checked_mul(bs).ok_or_else(absurd)?;
        let start = data_start
            .checked_add(info.offset)
            .ok_or_else(|| bad(format!("tensor `{name}` offset overflows")))?;
        let end = start
            .checked_add(nbytes)
            .ok_or_else(|| bad(format!("tensor `{name}` offset overflows")))?;
        if end > file_len {
            return Err(bad(format!(
                "tensor `{name}` (shape {:?}) ends at byte {end} but the file has {file_len} bytes: truncated or corrupt; download it again",
                info.dims
            )));
        }
        Ok(Some(Extent { ty, n, start, end }))
    }

    /// Upper bound on the f32 elements the tensors of this file can yield (the known-type
    /// tensors' element counts; they lie inside the file without overlapping).
    pub fn element_count(&self) -> u64 {
        self.tensors
            .iter()
            .filter_map(|(name, info)| {
                Self::extent(&self.path, self.mmap.len(), self.data_start, name, info)
                    .ok()
                    .flatten()
            })
            .fold(0u64, |a, e| a.saturating_add(e.n as u64))
    }

    /// A metadata value.
    pub fn meta(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    /// `general.architecture` (e.g. `llama`, `qwen2`).
    pub fn architecture(&self) -> &str {
        self.meta("general.architecture")
            .and_then(GgufValue::as_str)
            .unwrap_or("llama")
    }

    /// Read a tensor by its GGUF name, dequantised to f32 (row-major, outermost dim first).
    pub fn read_f32(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>), WeightsError> {
        let info = self
            .tensors
            .get(name)
            .ok_or_else(|| WeightsError::Missing {
                name: name.into(),
                files: self.path.clone(),
            })?;
        let Extent { ty, n, start, end } =
            Self::extent(&self.path, self.mmap.len(), self.data_start, name, info)?.ok_or_else(
                || WeightsError::Dtype {
                    name: name.into(),
                    dtype: ggml_type_name(info.type_id),
                },
            )?;
        let data = dequantize(ty, &self.mmap[start..end], n);
        let shape: Vec<usize> = info.dims.iter().rev().copied().collect();
        Ok((shape, data))
    }

    fn meta_usize(&self, key: &str) -> Option<usize> {
        self.meta(key)
            .and_then(GgufValue::as_u64)
            .map(|v| usize::try_from(v).unwrap_or(usize::MAX))
    }

    /// The model configuration from the `<arch>.*` metadata.
    pub fn config(&self) -> Result<TransformerConfig, WeightsError> {
        let arch = self.architecture().to_string();
        if arch != "llama" && arch != "qwen2" {
            return Err(WeightsError::Gguf {
                path: self.path.clone(),
                message: format!("architecture `{arch}` is not supported (llama, qwen2)"),
            });
        }
        let need = |k: &str| {
            self.meta_usize(&format!("{arch}.{k}"))
                .ok_or_else(|| WeightsError::Gguf {
                    path: self.path.clone(),
                    message: format!("metadata `{arch}.{k}` is missing"),
                })
        };
        let hidden = need("embedding_length")?;
        let heads = need("attention.head_count")?;
        let vocab = self
            .meta_usize(&format!("{arch}.vocab_size"))
            .or_else(|| match self.meta("tokenizer.ggml.tokens") {
                Some(GgufValue::Array(a)) => Some(a.len()),
                _ => None,
            })
            .ok_or_else(|| WeightsError::Gguf {
                path: self.path.clone(),
                message: "cannot tell the vocabulary size".into(),
            })?;
        let tok = |k: &str| {
            self.meta(&format!("tokenizer.ggml.{k}"))
                .and_then(GgufValue::as_u64)
                .and_then(|v| u32::try_from(v).ok())
        };
        let cfg = TransformerConfig {
            model_type: arch.clone(),
            vocab_size: vocab,
            hidden_size: hidden,
            intermediate_size: need("feed_forward_length")?,
            num_hidden_layers: need("block_count")?,
            num_attention_heads: heads,
            num_key_value_heads: Some(
                self.meta_usize(&format!("{arch}.attention.head_count_kv"))
                    .unwrap_or(heads),
            ),
            head_dim: self
                .meta_usize(&format!("{arch}.attention.key_length"))
                .or(Some(hidden / heads.max(1))),
            max_position_embeddings: self
                .meta_usize(&format!("{arch}.context_length"))
                .unwrap_or(2048),
            rope_theta: self
                .meta(&format!("{arch}.rope.freq_base"))
                .and_then(GgufValue::as_f64)
                .unwrap_or(10000.0),
            rms_norm_eps: self
                .meta(&format!("{arch}.attention.layer_norm_rms_epsilon"))
                .and_then(GgufValue::as_f64)
                .unwrap_or(1e-6),
            tie_word_embeddings: !self.tensors.contains_key("output.weight"),
            attention_bias: self.tensors.contains_key("blk.0.attn_q.bias"),
            bos_token_id: tok("bos_token_id"),
            eos_token_id: tok("eos_token_id").map(TokenIds::One),
            pad_token_id: tok("padding_token_id"),
            ..TransformerConfig::default()
        };
        cfg.validate().map_err(|e| WeightsError::Gguf {
            path: self.path.clone(),
            message: format!("{e} (from the `{arch}.*` metadata)"),
        })?;
        Ok(cfg)
    }

    /// Token strings of the embedded vocabulary (`tokenizer.ggml.tokens`).
    pub fn tokens(&self) -> Option<Vec<String>> {
        self.string_array("tokenizer.ggml.tokens")
    }

    /// BPE merges (`tokenizer.ggml.merges`), as `"a b"` strings.
    pub fn merges(&self) -> Option<Vec<String>> {
        self.string_array("tokenizer.ggml.merges")
    }

    /// Token types (`tokenizer.ggml.token_type`: 1 normal, 3 control, 4 user-defined, 6 byte).
    pub fn token_types(&self) -> Option<Vec<u32>> {
        match self.meta("tokenizer.ggml.token_type")? {
            GgufValue::Array(a) => Some(a.iter().map(|v| v.as_u64().unwrap_or(1) as u32).collect()),
            _ => None,
        }
    }

    fn string_array(&self, key: &str) -> Option<Vec<String>> {
        match self.meta(key)? {
            GgufValue::Array(a) => a.iter().map(|v| v.as_str().map(str::to_string)).collect(),
            _ => None,
        }
    }
}

/// Where a tensor's data lies (see [`GgufFile::extent`]).
struct Extent {
    ty: GgmlType,
    n: usize,
    start: usize,
    end: usize,
}

/// GGUF names for HF tensor names (Llama/Qwen2 scheme).
fn gguf_name(hf: &str) -> Option<String> {
    match hf {
        "model.embed_tokens.weight" => return Some("token_embd.weight".into()),
        "model.norm.weight" => return Some("output_norm.weight".into()),
        "lm_head.weight" => return Some("output.weight".into()),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (i, suffix) = rest.split_once('.')?;
    let (module, kind) = suffix.rsplit_once('.')?;
    let g = match module {
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "ffn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        _ => return None,
    };
    Some(format!("blk.{i}.{g}.{kind}"))
}

/// Undo llama.cpp's Q/K row permutation (convert_hf_to_gguf interleaves the two RoPE halves
/// of each head for `llama`): GGUF row `h*hd + 2i + j` is HF row `h*hd + j*hd/2 + i`.
fn unpermute_rows(data: &[f32], n_heads: usize, cols: usize) -> Vec<f32> {
    let rows = data.len() / cols;
    let hd = rows / n_heads;
    let mut out = vec![0f32; data.len()];
    for h in 0..n_heads {
        for i in 0..hd / 2 {
            for j in 0..2 {
                let src = h * hd + 2 * i + j;
                let dst = h * hd + j * (hd / 2) + i;
                out[dst * cols..(dst + 1) * cols]
                    .copy_from_slice(&data[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

/// A GGUF file seen through HF tensor names (see [`TensorSource`]).
pub struct GgufSource<'a> {
    file: &'a GgufFile,
    heads: usize,
    kv_heads: usize,
}

impl<'a> GgufSource<'a> {
    /// Wrap `file`; `cfg` gives the head counts for the Q/K un-permutation.
    pub fn new(file: &'a GgufFile, cfg: &TransformerConfig) -> Self {
        Self {
            file,
            heads: cfg.num_attention_heads,
            kv_heads: cfg.kv_heads(),
        }
    }
}

impl TensorSource for GgufSource<'_> {
    fn contains(&self, name: &str) -> bool {
        gguf_name(name).is_some_and(|g| self.file.tensors.contains_key(&g))
    }

    fn read_f32(&self, name: &str, expected: &[usize]) -> Result<Vec<f32>, WeightsError> {
        let g = gguf_name(name).ok_or_else(|| WeightsError::Missing {
            name: name.into(),
            files: self.file.path.clone(),
        })?;
        let (shape, data) = self.file.read_f32(&g).map_err(|e| match e {
            WeightsError::Missing { files, .. } => WeightsError::Missing {
                name: format!("{name} (GGUF `{g}`)"),
                files,
            },
            other => other,
        })?;
        if shape != expected {
            return Err(WeightsError::Shape {
                name: format!("{name} (GGUF `{g}`)"),
                expected: expected.to_vec(),
                found: shape,
            });
        }
        if self.file.architecture() == "llama" && expected.len() == 2 {
            if g.ends_with("attn_q.weight") {
                return Ok(unpermute_rows(&data, self.heads, expected[1]));
            }
            if g.ends_with("attn_k.weight") {
                return Ok(unpermute_rows(&data, self.kv_heads, expected[1]));
            }
        }
        Ok(data)
    }

    fn describe(&self) -> String {
        self.file.path.clone()
    }

    fn element_count(&self) -> Option<u64> {
        Some(self.file.element_count())
    }
}

/// Load a GGUF model onto `device`: its config and dequantised f32 weights. Never panics and
/// never allocates more than the file can back (see the module docs).
pub fn load_gguf(
    path: impl AsRef<Path>,
    device: &burn::tensor::Device,
) -> Result<crate::model::Transformer, WeightsError> {
    let file = GgufFile::open(path)?;
    let cfg = file.config()?;
    let src = GgufSource::new(&file, &cfg);
    crate::weights::load_transformer(&cfg, &src, device)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_0_and_q8_0_blocks() {
        // d = 0.5 (f16 0x3800); nibbles 0..15 -> (q - 8) * 0.5
        let mut b = vec![0x00, 0x38];
        b.extend((0..16u8).map(|i| i | ((15 - i) << 4)));
        let v = dequantize(GgmlType::Q4_0, &b, 32);
        assert_eq!(v[0], -4.0);
        assert_eq!(v[15], 3.5);
        assert_eq!(v[16], 3.5);
        let mut b = vec![0x00, 0x3c]; // d = 1.0
        b.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let v = dequantize(GgmlType::Q8_0, &b, 32);
        assert_eq!(v[0], -16.0);
        assert_eq!(v[31], 15.0);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        let dir = tempfile::tempdir().unwrap();
        for (i, bytes) in [
            b"".to_vec(),
            b"GGU".to_vec(),
            b"GGUF\x03\x00\x00\x00".to_vec(),
            b"GGUF\x03\x00\x00\x00\xff\xff\xff\xff\xff\xff\xff\xff\x00\x00\x00\x00\x00\x00\x00\x00"
                .to_vec(),
            b"NOPE\x03\x00\x00\x00".to_vec(),
        ]
        .iter()
        .enumerate()
        {
            let p = dir.path().join(format!("{i}.gguf"));
            std::fs::write(&p, bytes).unwrap();
            assert!(GgufFile::open(&p).is_err());
        }
    }

    /// A GGUF v3 file with no metadata and one tensor `t` of type `ty`, dims `dims`, at `offset`.
    fn one_tensor(dims: &[u64], ty: u32, offset: u64, data: &[u8]) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend(1u64.to_le_bytes()); // tensors
        b.extend(0u64.to_le_bytes()); // metadata
        b.extend(1u64.to_le_bytes());
        b.push(b't');
        b.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(ty.to_le_bytes());
        b.extend(offset.to_le_bytes());
        b.resize(b.len().div_ceil(32) * 32, 0);
        b.extend(data);
        b
    }

    #[test]
    fn huge_dims_are_an_error_not_a_panic() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.gguf");
        // [2^62] F32: 2^62 x 4 bytes wraps to 0 in unchecked arithmetic.
        for (dims, ty) in [
            (vec![1u64 << 62], 0u32),
            (vec![1 << 31, 1 << 31, 4], 0),
            (vec![u64::MAX], 0),
            (vec![1 << 60], 2),
            (vec![4, 1 << 40], 1),
        ] {
            std::fs::write(&p, one_tensor(&dims, ty, 0, &[0u8; 64])).unwrap();
            let r = GgufFile::open(&p).and_then(|f| f.read_f32("t"));
            assert!(r.is_err(), "{dims:?}");
        }
        // The same file with a sane shape reads.
        std::fs::write(&p, one_tensor(&[4, 2], 0, 0, &[0u8; 32])).unwrap();
        let (shape, v) = GgufFile::open(&p).unwrap().read_f32("t").unwrap();
        assert_eq!((shape, v.len()), (vec![2, 4], 8));
        // Offsets past the end, and an offset that overflows.
        for off in [64u64, u64::MAX - 8] {
            std::fs::write(&p, one_tensor(&[4], 0, off, &[0u8; 16])).unwrap();
            assert!(GgufFile::open(&p).is_err(), "offset {off}");
        }
    }

    #[test]
    fn dequantize_never_yields_more_than_the_data() {
        assert_eq!(dequantize(GgmlType::F32, &[0u8; 8], 1 << 62).len(), 2);
        assert!(dequantize(GgmlType::Q4K, &[0u8; 100], usize::MAX).is_empty());
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        // HF rows r (2 heads, hd 4, 1 col); llama.cpp permute: reshape(h, 2, hd/2).swap(1, 2).
        let hf: Vec<f32> = (0..8).map(|x| x as f32).collect();
        let mut gg = vec![0f32; 8];
        for h in 0..2 {
            for i in 0..2 {
                for j in 0..2 {
                    gg[h * 4 + 2 * i + j] = hf[h * 4 + j * 2 + i];
                }
            }
        }
        assert_eq!(unpermute_rows(&gg, 2, 1), hf);
    }
}
