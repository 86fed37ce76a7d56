//! Rotary embedding parameters: `rope_theta` and scaling, as transformers 4 (`rope_theta`,
//! `rope_scaling`) and 5 (`rope_parameters`) write them, turned into inverse frequencies.

use super::config::ConfigReader;
use crate::{DType, Result};
use serde::{Deserialize, Serialize};

/// How inverse frequencies are scaled.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "rope_type", rename_all = "snake_case")]
pub enum RopeScaling {
    /// No scaling.
    Default,
    /// Every frequency divided by `factor`.
    Linear {
        /// The divisor.
        factor: f64,
    },
    /// Llama 3's wavelength-dependent scaling.
    Llama3 {
        /// Divisor of low frequencies.
        factor: f64,
        /// Wavelengths above `original_max_position_embeddings / low_freq_factor` are divided.
        low_freq_factor: f64,
        /// Wavelengths below `original_max_position_embeddings / high_freq_factor` are kept.
        high_freq_factor: f64,
        /// The context length of pre-training.
        original_max_position_embeddings: f64,
    },
    /// Phi-3's longrope: per-frequency divisors, the short ones below
    /// `original_max_position_embeddings` and the long ones from it on, and cos and sin
    /// multiplied by `attention_factor`.
    Longrope {
        /// Divisors of the frequencies at positions below the original context.
        short_factor: Vec<f64>,
        /// Divisors from the original context on.
        long_factor: Vec<f64>,
        /// The context length of pre-training.
        original_max_position_embeddings: u64,
        /// What cos and sin are multiplied by: the config's, or
        /// `sqrt(1 + ln(s) / ln(original))` with `s = max_position_embeddings / original`.
        attention_factor: f64,
    },
    /// YaRN: frequencies that turn fewer than `beta_slow` times over the original context are
    /// divided by `factor`, those that turn more than `beta_fast` times are kept, a linear ramp
    /// between; cos and sin multiplied by `attention_factor`.
    Yarn {
        /// The context extension.
        factor: f64,
        /// The context length of pre-training.
        original_max_position_embeddings: f64,
        /// What cos and sin are multiplied by: the config's, or `0.1 ln(factor) + 1` (with
        /// `mscale` / `mscale_all_dim`, their ratio of that form).
        attention_factor: f64,
        /// Rotations over the original context above which a frequency is kept.
        beta_fast: f64,
        /// Rotations below which a frequency is divided by `factor`.
        beta_slow: f64,
        /// The ramp's ends rounded outwards to whole dims.
        truncate: bool,
    },
    /// Dynamic NTK: the base grows once a sequence passes `max_position_embeddings`; below it
    /// the frequencies are the default ones. maxc compiles it for contexts up to
    /// `max_position_embeddings`, where it is exact ([`RopeConfig::check_context`]).
    Dynamic {
        /// The scaling factor past the context.
        factor: f64,
        /// The context below which the frequencies are the default ones.
        max_position_embeddings: u64,
    },
}

/// Rotary embedding parameters of one decoder.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RopeConfig {
    /// Base of the frequencies.
    pub theta: f64,
    /// Frequency scaling.
    pub scaling: RopeScaling,
}

impl RopeConfig {
    /// Reads `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (transformers 4).
    pub fn read(cfg: &ConfigReader<'_>) -> Result<Self> {
        Self::read_from(
            cfg,
            cfg.child("rope_parameters")?,
            cfg.child("rope_scaling")?,
        )
    }

    /// Reads rotary parameters from `params` (a `rope_parameters` object, or one of its
    /// per-layer-type entries) or `legacy` (a `rope_scaling` object), `cfg` holding the
    /// top-level fields (`rope_theta`, the context lengths).
    pub fn read_from(
        cfg: &ConfigReader<'_>,
        params: Option<ConfigReader<'_>>,
        legacy: Option<ConfigReader<'_>>,
    ) -> Result<Self> {
        let theta = match params
            .as_ref()
            .map(|p| p.opt_f64("rope_theta"))
            .transpose()?
            .flatten()
        {
            Some(t) => t,
            None => cfg.opt_f64("rope_theta")?.unwrap_or(10000.0),
        };
        if theta <= 0.0 {
            return Err(cfg.error(
                "rope_theta",
                format!("is {theta}; expected a positive number"),
            ));
        }
        let scaling = match params.or(legacy) {
            None => RopeScaling::Default,
            Some(p) => {
                let kind = match p.opt_str("rope_type")? {
                    Some(k) => k,
                    None => p.opt_str("type")?.unwrap_or("default"),
                };
                let num = |key: &str| {
                    p.opt_f64(key)?.ok_or_else(|| {
                        p.error(key, format!("missing; rope_type `{kind}` needs it"))
                    })
                };
                let factors = |key: &str| -> Result<Vec<f64>> {
                    let v = p.get(key).ok_or_else(|| {
                        p.error(key, format!("missing; rope_type `{kind}` needs it"))
                    })?;
                    v.as_array()
                        .and_then(|a| a.iter().map(|x| x.as_f64()).collect())
                        .ok_or_else(|| {
                            p.error(key, format!("expected a list of numbers, found {v}"))
                        })
                };
                match kind {
                    "default" => RopeScaling::Default,
                    "longrope" | "su" => {
                        let original = match p.opt_usize("original_max_position_embeddings")? {
                            Some(o) => o,
                            None => cfg.positive("original_max_position_embeddings")?,
                        };
                        let max = cfg.opt_usize("max_position_embeddings")?.unwrap_or(original);
                        let scale = max as f64 / original as f64;
                        let attention_factor = match p.opt_f64("attention_factor")? {
                            Some(a) => a,
                            None if scale <= 1.0 => 1.0,
                            None => (1.0 + scale.ln() / (original as f64).ln()).sqrt(),
                        };
                        RopeScaling::Longrope {
                            short_factor: factors("short_factor")?,
                            long_factor: factors("long_factor")?,
                            original_max_position_embeddings: original as u64,
                            attention_factor,
                        }
                    }
                    "linear" => RopeScaling::Linear {
                        factor: num("factor")?,
                    },
                    "yarn" => read_yarn(cfg, &p)?,
                    "dynamic" => RopeScaling::Dynamic {
                        factor: num("factor")?,
                        max_position_embeddings: cfg.positive("max_position_embeddings")? as u64,
                    },
                    "llama3" => RopeScaling::Llama3 {
                        factor: num("factor")?,
                        low_freq_factor: num("low_freq_factor")?,
                        high_freq_factor: num("high_freq_factor")?,
                        original_max_position_embeddings: num("original_max_position_embeddings")?,
                    },
                    other => {
                        return Err(p.error(
                            "rope_type",
                            format!(
                                "`{other}` is not supported; expected default, linear, llama3, longrope, yarn or dynamic"
                            ),
                        ))
                    }
                }
            }
        };
        Ok(RopeConfig { theta, scaling })
    }

    /// A compiled context of `max_seq_len` positions is one these frequencies are exact for:
    /// dynamic NTK changes its frequencies past `max_position_embeddings`, which maxc does not
    /// (every cached key keeps the rotation it was stored with).
    pub fn check_context(&self, max_seq_len: usize) -> std::result::Result<(), String> {
        match self.scaling {
            RopeScaling::Dynamic {
                max_position_embeddings,
                ..
            } if max_seq_len as u64 > max_position_embeddings => Err(format!(
                "is {max_seq_len}, past max_position_embeddings ({max_position_embeddings}), where rope_type `dynamic` would rescale its frequencies; maxc compiles dynamic NTK up to that context (expected at most {max_position_embeddings})"
            )),
            _ => Ok(()),
        }
    }

    /// The rotary table of heads whose first `rotary_dim` elements rotate: [`Self::inv_freq`]'s
    /// frequencies, and longrope's scale and long frequencies (from the original context on, per
    /// position: a sequence's keys keep the rotation they were cached with, as transformers'
    /// keys do once a generation passes the original context).
    pub fn table(&self, rotary_dim: usize, stored: DType) -> maxc_schema::RopeTable {
        let mut t = maxc_schema::RopeTable::new(self.inv_freq(rotary_dim, stored));
        if let RopeScaling::Yarn {
            attention_factor, ..
        } = &self.scaling
        {
            t.scale = *attention_factor as f32;
        }
        if let RopeScaling::Longrope {
            long_factor,
            short_factor,
            original_max_position_embeddings,
            attention_factor,
        } = &self.scaling
        {
            t.scale = *attention_factor as f32;
            if long_factor != short_factor {
                let long = RopeConfig {
                    theta: self.theta,
                    scaling: RopeScaling::Longrope {
                        short_factor: long_factor.clone(),
                        long_factor: long_factor.clone(),
                        original_max_position_embeddings: *original_max_position_embeddings,
                        attention_factor: *attention_factor,
                    },
                };
                t.long = Some(maxc_schema::LongFreqs {
                    inv_freq: long.inv_freq(rotary_dim, stored),
                    from: *original_max_position_embeddings,
                });
            }
        }
        t
    }

    /// The `head_dim / 2` inverse frequencies, computed in f32 as transformers does, then rounded
    /// to `stored` where that is a 16-bit float: transformers keeps the frequencies in a buffer
    /// that is cast with the model, so a checkpoint loaded in its stored bf16 rotates with
    /// bf16-rounded frequencies. maxc does the same, to agree with the reference.
    pub fn inv_freq(&self, head_dim: usize, stored: DType) -> Vec<f32> {
        let round: fn(f32) -> f32 = match stored {
            DType::BF16 => |f| half::bf16::from_f32(f).to_f32(),
            DType::F16 => |f| half::f16::from_f32(f).to_f32(),
            _ => |f| f,
        };
        self.unrounded_inv_freq(head_dim)
            .into_iter()
            .map(round)
            .collect()
    }

    fn unrounded_inv_freq(&self, head_dim: usize) -> Vec<f32> {
        let base = self.theta as f32;
        let pow: Vec<f32> = (0..head_dim)
            .step_by(2)
            .map(|i| base.powf(i as f32 / head_dim as f32))
            .collect();
        let default: Vec<f32> = pow.iter().map(|p| 1.0 / p).collect();
        match &self.scaling {
            RopeScaling::Default | RopeScaling::Dynamic { .. } => default,
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                truncate,
                ..
            } => {
                // transformers' _compute_yarn_parameters: the correction range in f64, the
                // frequencies and the ramp in f32.
                let (dim, base) = (head_dim as f64, self.theta);
                let correction = |rotations: f64| {
                    dim * (original_max_position_embeddings
                        / (rotations * 2.0 * std::f64::consts::PI))
                        .ln()
                        / (2.0 * base.ln())
                };
                let (mut low, mut high) = (correction(*beta_fast), correction(*beta_slow));
                if *truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
                if low == high {
                    high += 0.001;
                }
                let span = (high - low) as f32;
                pow.iter()
                    .enumerate()
                    .map(|(i, &p)| {
                        let ramp = ((i as f32 - low as f32) / span).clamp(0.0, 1.0);
                        let extrapolation = 1.0 - ramp;
                        let interpolated = 1.0 / (*factor as f32 * p);
                        interpolated * (1.0 - extrapolation) + (1.0 / p) * extrapolation
                    })
                    .collect()
            }
            // 1 / (factor · base^(2i/d)), the factor in f32 as transformers holds it.
            RopeScaling::Longrope { short_factor, .. } => pow
                .iter()
                .zip(short_factor)
                .map(|(&p, &s)| 1.0 / (s as f32 * p))
                .collect(),
            RopeScaling::Linear { factor } => default.iter().map(|f| f / *factor as f32).collect(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let (factor, low, high, old) = (
                    *factor as f32,
                    *low_freq_factor as f32,
                    *high_freq_factor as f32,
                    *original_max_position_embeddings as f32,
                );
                let low_freq_wavelen = old / low;
                let high_freq_wavelen = old / high;
                default
                    .iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f32::consts::PI / f;
                        if wavelen > low_freq_wavelen {
                            f / factor
                        } else if wavelen < high_freq_wavelen {
                            f
                        } else {
                            let smooth = (old / wavelen - low) / (high - low);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
        }
    }
}

/// YaRN's parameters, with transformers' defaults: `original_max_position_embeddings` from the
/// rope parameters, else the config's (Phi's place for it), else `max_position_embeddings`;
/// `factor` absent is their ratio; the attention factor from `mscale` / `mscale_all_dim` or the
/// factor; `beta_fast` 32, `beta_slow` 1, `truncate` true.
fn read_yarn(cfg: &ConfigReader<'_>, p: &ConfigReader<'_>) -> Result<RopeScaling> {
    let original = match p.opt_f64("original_max_position_embeddings")? {
        Some(o) => o,
        None => match cfg.opt_f64("original_max_position_embeddings")? {
            Some(o) => o,
            None => cfg.positive("max_position_embeddings")? as f64,
        },
    };
    if original <= 0.0 {
        return Err(p.error(
            "original_max_position_embeddings",
            format!("is {original}; expected a positive context length"),
        ));
    }
    let factor = match p.opt_f64("factor")? {
        Some(f) => f,
        None => cfg.positive("max_position_embeddings")? as f64 / original,
    };
    if factor <= 0.0 {
        return Err(p.error("factor", format!("is {factor}; expected a positive number")));
    }
    let mscale = |scale: f64, m: f64| {
        if scale <= 1.0 {
            1.0
        } else {
            0.1 * m * scale.ln() + 1.0
        }
    };
    let attention_factor = match p.opt_f64("attention_factor")? {
        Some(a) => a,
        None => match (p.opt_f64("mscale")?, p.opt_f64("mscale_all_dim")?) {
            (Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                mscale(factor, m) / mscale(factor, all)
            }
            _ => mscale(factor, 1.0),
        },
    };
    // transformers reads `x or default`: 0 takes the default too.
    let beta = |key: &str, default: f64| -> Result<f64> {
        Ok(p.opt_f64(key)?.filter(|b| *b != 0.0).unwrap_or(default))
    };
    Ok(RopeScaling::Yarn {
        factor,
        original_max_position_embeddings: original,
        attention_factor,
        beta_fast: beta("beta_fast", 32.0)?,
        beta_slow: beta("beta_slow", 1.0)?,
        truncate: p.opt_bool("truncate")?.unwrap_or(true),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::path::Path;

    fn read(v: serde_json::Value) -> Result<RopeConfig> {
        RopeConfig::read(&ConfigReader::new(Path::new("config.json"), &v)?)
    }

    #[test]
    fn theta_from_either_transformers_layout() {
        assert_eq!(
            read(json!({"rope_theta": 500000.0})).unwrap().theta,
            500000.0
        );
        let v5 =
            read(json!({"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}})).unwrap();
        assert_eq!((v5.theta, v5.scaling), (1e6, RopeScaling::Default));
        assert_eq!(read(json!({})).unwrap().theta, 10000.0);
    }

    #[test]
    fn llama3_scaling_matches_the_reference_formula() {
        // Llama 3.1's settings; values from transformers' _compute_llama3_parameters.
        let cfg = read(json!({"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}))
        .unwrap();
        let f = cfg.inv_freq(128, DType::F32);
        assert_eq!(f.len(), 64);
        assert_eq!(f[0], 1.0); // high frequency: kept
        let base = RopeConfig {
            theta: 500000.0,
            scaling: RopeScaling::Default,
        }
        .inv_freq(128, DType::F32);
        assert!((f[63] - base[63] / 8.0).abs() < 1e-12); // low frequency: divided by factor
                                                         // Medium band: strictly between the two.
        let mid = (0..64)
            .find(|&i| f[i] != base[i] && (f[i] - base[i] / 8.0).abs() > 1e-12)
            .unwrap();
        assert!(f[mid] < base[mid] && f[mid] > base[mid] / 8.0);
    }

    #[test]
    fn frequencies_follow_a_bf16_checkpoint() {
        let cfg = read(json!({"rope_theta": 10000.0})).unwrap();
        let (f32_freqs, bf16_freqs) = (cfg.inv_freq(32, DType::F32), cfg.inv_freq(32, DType::BF16));
        for (a, b) in f32_freqs.iter().zip(&bf16_freqs) {
            assert_eq!(*b, half::bf16::from_f32(*a).to_f32());
        }
        assert_ne!(f32_freqs, bf16_freqs);
    }

    #[test]
    fn unknown_rope_type_names_the_field() {
        let err =
            read(json!({"rope_parameters": {"rope_type": "ntk-by-parts", "rope_theta": 1.0}}))
                .unwrap_err()
                .to_string();
        assert!(
            err.contains("rope_parameters.rope_type")
                && err.contains("ntk-by-parts")
                && err.contains("yarn"),
            "{err}"
        );
    }

    #[test]
    fn longrope_uses_short_factors_then_long_ones_from_the_original_context() {
        let cfg = read(json!({"max_position_embeddings": 512, "rope_parameters": {
            "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 128,
            "short_factor": [1.0, 2.0], "long_factor": [3.0, 4.0]}}))
        .unwrap();
        let t = cfg.table(4, DType::F32);
        let pow = [1.0f32, 10000f32.powf(0.5)];
        assert_eq!(t.inv_freq, vec![1.0 / pow[0], 1.0 / (2.0 * pow[1])]);
        let long = t.long.as_ref().unwrap();
        assert_eq!(long.from, 128);
        assert_eq!(
            long.inv_freq,
            vec![1.0 / (3.0 * pow[0]), 1.0 / (4.0 * pow[1])]
        );
        // sqrt(1 + ln(512 / 128) / ln(128)), transformers' attention factor.
        let want = (1.0 + 4f64.ln() / 128f64.ln()).sqrt() as f32;
        assert_eq!(t.scale, want);
        assert_eq!(t.freqs(127), &t.inv_freq[..]);
        assert_eq!(t.freqs(128), &long.inv_freq[..]);
        let (c, _) = t.cos_sin(0, 0);
        assert_eq!(c, want);
    }
}
