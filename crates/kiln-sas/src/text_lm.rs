//! kiln-lm's masked-diffusion transformer as the frozen denoiser of text SAS: loading it (an HF
//! folder, a GGUF file, a zoo name, or the tiny random byte-level preset of the CPU smoke test),
//! its tokenizer, and the [`crate::text::StatsForward`] that reduces its predictions on the device.

use std::path::Path;

use burn::module::Module;
use burn::tensor::activation::log_softmax;
use burn::tensor::{Bool, Device, Int, Tensor, TensorData};
use kiln_lm::TransformerConfig;
use kiln_rl::{Context, PipelineError};

use crate::text::PosStats;

type Result<T> = std::result::Result<T, PipelineError>;

/// The masked-diffusion LM of a `sas_gsm8k` run and how text becomes tokens.
pub struct TextLm {
    /// The transformer (bidirectional, with a mask token).
    pub model: kiln_lm::Transformer,
    /// Its tokenizer; `None` = bytes are tokens (the tiny preset).
    pub tokenizer: Option<kiln_lm::Tokenizer>,
    /// The mask token id.
    pub mask: u32,
    /// Token that left-pads prompts and pads answers.
    pub pad: u32,
}

impl TextLm {
    /// Token ids of `text`.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match &self.tokenizer {
            Some(t) => t.encode(text, false).map_err(PipelineError::msg),
            None => Ok(byte_tokens(text, self.mask)),
        }
    }

    /// Text of `ids` (special tokens skipped).
    pub fn decode(&self, ids: &[u32]) -> String {
        match &self.tokenizer {
            Some(t) => t.decode(ids, true).unwrap_or_default(),
            None => ids.iter().map(|&b| (b.min(255) as u8) as char).collect(),
        }
    }

    /// Vocabulary size.
    pub fn vocab(&self) -> usize {
        self.model.config().vocab_size
    }
}

/// Where the tiny preset's weights are kept inside a run (so `kiln eval` reloads the same ones).
const TINY_LM_FILE: &str = "denoiser-lm.bpk";

/// Load the LM: the HF folder / GGUF / zoo name `model_path`, or (when it is empty) the tiny
/// preset `tiny` (initialised from the run's `seed` and saved to `run_dir`, or reloaded from there
/// when it exists). Answers are padded with `answer_pad`, else the model's EOS, else its pad
/// token, else 0.
pub fn load_text_lm(
    model_path: &str,
    tiny: &TransformerConfig,
    answer_pad: Option<u32>,
    device: &Device,
    run_dir: &Path,
    seed: u64,
) -> Result<TextLm> {
    let (model, tokenizer) = if model_path.is_empty() {
        let path = run_dir.join(TINY_LM_FILE);
        let m = if path.is_file() {
            tiny.init(device).try_load_file(&path).map_err(|e| {
                PipelineError(format!(
                    "{}: cannot load the tiny denoiser: {e}",
                    path.display()
                ))
            })?
        } else {
            device.seed(seed);
            let m = tiny.init(device);
            std::fs::create_dir_all(run_dir)?;
            m.clone()
                .save_file(&path)
                .map_err(|e| PipelineError(format!("{}: {e}", path.display())))?;
            m
        };
        (m, None)
    } else {
        let (m, t) = kiln_lm::zoo::load_with_tokenizer(model_path, device)
            .with_context(|| format!("loading the masked-diffusion LM `{model_path}`"))?;
        (m, Some(t))
    };
    let cfg = model.config();
    let mask = cfg.mask_token_id.ok_or_else(|| {
        PipelineError(format!(
            "`{}` has no mask_token_id: SAS needs a masked-diffusion LM (LLaDA)",
            if model_path.is_empty() {
                "model"
            } else {
                model_path
            }
        ))
    })?;
    if cfg.causal {
        return Err(PipelineError(format!(
            "`{model_path}` is a causal LM; SAS needs a bidirectional masked-diffusion LM"
        )));
    }
    let pad = answer_pad
        .or_else(|| {
            cfg.eos_token_id
                .as_ref()
                .and_then(|e| e.to_vec().first().copied())
        })
        .or(cfg.pad_token_id)
        .unwrap_or(0);
    Ok(TextLm {
        model,
        tokenizer,
        mask,
        pad,
    })
}

/// True-on-real-token mask of `b` rows of `len` tokens whose leading run of `pad` tokens is
/// left padding; `None` when no row is padded (the plain forward is then the same and cheaper).
/// A row made only of `pad` tokens is left unmasked (masking every key would be undefined).
fn left_padding_mask(toks: &[u32], b: usize, len: usize, pad: u32) -> Option<Vec<bool>> {
    let mut any = false;
    let mut m = vec![true; b * len];
    for (r, row) in toks.chunks(len.max(1)).take(b).enumerate() {
        let lead = row.iter().take_while(|&&t| t == pad).count();
        if lead > 0 && lead < row.len() {
            any = true;
            m[r * len..r * len + lead].fill(false);
        }
    }
    any.then_some(m)
}

/// The [`StatsForward`] of a kiln-lm transformer: everything is reduced on the device (top-2
/// probabilities, entropy, argmax, target log-prob), so only 5 numbers per position reach the
/// host whatever the vocabulary; the mask token is never a prediction.
///
/// Prompts of a batch are left-padded with `pad` ([`left_pad`]): the leading run of `pad`
/// tokens of each row is masked out of attention (and positions start at the first real token),
/// so a padded row gets the same predictions as the same row alone. `pad` tokens after the first
/// real token are real (LLaDA pads answers with its EOS and was trained to predict them).
pub fn stats_forward(
    model: &kiln_lm::Transformer,
    mask: u32,
    pad: u32,
) -> impl FnMut(&[u32], usize, usize, Option<&[u32]>) -> Vec<PosStats> + '_ {
    let device = model.device();
    let v = model.config().vocab_size;
    let mut bias = vec![0f32; v];
    if (mask as usize) < v {
        bias[mask as usize] = -1.0e9;
    }
    let bias = Tensor::<1>::from_data(TensorData::new(bias, [v]), &device);
    move |toks: &[u32], b: usize, len: usize, targets: Option<&[u32]>| {
        let host = |t: &[u32]| -> Vec<i64> { t.iter().map(|&x| x as i64).collect() };
        let tt = Tensor::<2, Int>::from_data(TensorData::new(host(toks), [b, len]), &device);
        let real = left_padding_mask(toks, b, len, pad);
        let logits = match real {
            Some(m) => {
                let m = Tensor::<2, Bool>::from_data(TensorData::new(m, [b, len]), &device);
                model.forward_masked(tt, m)
            }
            None => model.forward(tt),
        } + bias.clone().reshape([1, 1, v]);
        let lp = log_softmax(logits, 2);
        let top2 = lp.clone().topk(2, 2);
        let arg = lp.clone().argmax(2);
        let ent = (lp.clone().exp() * lp.clone()).sum_dim(2).neg();
        let tgt = targets.map(|t| {
            let ti = Tensor::<3, Int>::from_data(TensorData::new(host(t), [b, len, 1]), &device);
            lp.clone().gather(2, ti)
        });
        let f = |t: Tensor<3>| -> Vec<f32> {
            t.into_data()
                .convert::<f32>()
                .try_into_vec()
                .unwrap_or_default()
        };
        let top2 = f(top2);
        let ent = f(ent);
        let arg: Vec<i64> = arg
            .into_data()
            .convert::<i64>()
            .try_into_vec()
            .unwrap_or_default();
        let tgt = tgt.map(f);
        (0..b * len)
            .map(|i| {
                let (a, c) = (top2[2 * i].exp(), top2[2 * i + 1].exp());
                PosStats {
                    top1: a,
                    margin: a - c,
                    entropy: ent[i],
                    argmax: arg[i] as u32,
                    target_lp: tgt.as_ref().map_or(0.0, |t| t[i]),
                }
            })
            .collect()
    }
}

/// Byte-level tokenizer of the CPU smoke preset: bytes are tokens; the mask id never occurs in
/// text (bytes equal to it are replaced by a space).
pub fn byte_tokens(text: &str, mask: u32) -> Vec<u32> {
    text.bytes()
        .map(|b| if b as u32 == mask { 32 } else { b as u32 })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn left_padding_mask_covers_the_leading_pad_run_only() {
        let pad = 9;
        // Row 0 unpadded, row 1 padded by two (and a pad token later on, which is real).
        let toks = [1, 2, 3, 9, 9, 9, 1, 9];
        let m = left_padding_mask(&toks, 2, 4, pad).unwrap();
        assert_eq!(m, vec![true, true, true, true, false, false, true, true]);
        assert!(left_padding_mask(&[1, 9, 2, 9], 2, 2, pad).is_none());
        // A row of padding only stays unmasked.
        assert!(left_padding_mask(&[9, 9, 1, 2], 2, 2, pad).is_none());
    }

    /// A left-padded prompt must get the predictions it gets alone; the plain forward (what
    /// decoding did before) does not, so this test fails without the padding mask.
    #[test]
    fn stats_of_a_left_padded_row_match_the_row_alone() {
        let device = Device::flex();
        device.seed(3);
        let model = crate::pipeline::gsm8k::GsmRecipe::default()
            .model
            .init(&device);
        let (mask, pad) = (255u32, 0u32);
        let row: Vec<u32> = vec![72, 105, 33, 255, 255, 255, 10, 255];
        let len = row.len();
        let mut fwd = stats_forward(&model, mask, pad);
        let alone = fwd(&row, 1, len, Some(&row));
        // Batch: another unpadded row of length len + 3, and `row` left-padded by 3.
        let other: Vec<u32> = (0..len as u32 + 3).map(|i| 40 + i).collect();
        let mut padded = vec![pad; 3];
        padded.extend_from_slice(&row);
        let toks: Vec<u32> = other.iter().chain(&padded).copied().collect();
        let both = fwd(&toks, 2, len + 3, Some(&toks));
        for (i, a) in alone.iter().enumerate() {
            let p = &both[len + 3 + 3 + i];
            assert!((a.top1 - p.top1).abs() < 1e-5, "pos {i}: {a:?} vs {p:?}");
            assert!((a.margin - p.margin).abs() < 1e-5, "pos {i}");
            assert!((a.entropy - p.entropy).abs() < 1e-4, "pos {i}");
            assert!((a.target_lp - p.target_lp).abs() < 1e-4, "pos {i}");
            assert_eq!(a.argmax, p.argmax, "pos {i}");
        }
        // The unpadded row of the batch is unaffected by the mask of its neighbour.
        let other_alone = fwd(&other, 1, len + 3, Some(&other));
        for (a, p) in other_alone.iter().zip(&both[..len + 3]) {
            assert!((a.entropy - p.entropy).abs() < 1e-4);
        }
        // Control: attending to the padding changes the predictions of this model.
        let pt = Tensor::<2, Int>::from_data(
            TensorData::new(
                padded.iter().map(|&x| x as i64).collect::<Vec<_>>(),
                [1, len + 3],
            ),
            &device,
        );
        let at = Tensor::<2, Int>::from_data(
            TensorData::new(row.iter().map(|&x| x as i64).collect::<Vec<_>>(), [1, len]),
            &device,
        );
        let lp = model.forward(pt).slice([0..1, 3..len + 3]);
        let la = model.forward(at);
        let d = (lp - la).abs().max().into_scalar::<f32>();
        assert!(d > 1e-3, "padding should matter without the mask ({d})");
    }
}
