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
                                "`{other}` is not supported; expected default, linear, llama3 or longrope"
                            ),
                        ))
                    }
                }
            }
        };
        Ok(RopeConfig { theta, scaling })
    }

    /// The rotary table of heads whose first `rotary_dim` elements rotate: [`Self::inv_freq`]'s
    /// frequencies, and longrope's scale and long frequencies (from the original context on, per
    /// position: a sequence's keys keep the rotation they were cached with, as transformers'
    /// keys do once a generation passes the original context).
    pub fn table(&self, rotary_dim: usize, stored: DType) -> maxc_schema::RopeTable {
        let mut t = maxc_schema::RopeTable::new(self.inv_freq(rotary_dim, stored));
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
            RopeScaling::Default => default,
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
        let err = read(json!({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("rope_parameters.rope_type") && err.contains("yarn"),
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
