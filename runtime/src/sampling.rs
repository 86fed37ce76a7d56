//! Choosing the next token from logits: greedy, or temperature, top-k, top-p and min-p sampling
//! with a seeded generator (the same seed gives the same tokens), after the repetition,
//! frequency and presence penalties.

use std::collections::BTreeMap;

/// How tokens are chosen.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax, ties to the lower id).
    pub temperature: f32,
    /// Nucleus: sample among the most likely tokens whose probabilities sum to at least this.
    pub top_p: f32,
    /// Seed of the generator.
    pub seed: u64,
    /// Sample among the `top_k` most likely tokens only (0: all).
    pub top_k: usize,
    /// Drop tokens less likely than `min_p` times the most likely one (0: none).
    pub min_p: f32,
    /// Divides positive logits (multiplies negative ones) of every token already in the prompt
    /// or the output (1: off), as Hugging Face's `repetition_penalty`.
    pub repetition_penalty: f32,
    /// Subtracted from a token's logit once per time it was generated (OpenAI's meaning).
    pub frequency_penalty: f32,
    /// Subtracted from a token's logit if it was generated at all (OpenAI's meaning).
    pub presence_penalty: f32,
    /// Added to a token's logit before sampling, greedy included (OpenAI's `logit_bias`: from
    /// -100, which bans the token in effect, to 100, which forces it), by token id.
    pub logit_bias: BTreeMap<u32, f32>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            logit_bias: BTreeMap::new(),
        }
    }
}

impl SamplingParams {
    /// Whether any penalty applies (the logits then need the token history).
    pub fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.frequency_penalty != 0.0
            || self.presence_penalty != 0.0
    }

    /// Adds each token's `logit_bias` to its logit (ids outside `logits` are skipped).
    pub fn bias(&self, logits: &mut [f32]) {
        for (&t, &b) in &self.logit_bias {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += b;
            }
        }
    }

    /// Applies the penalties to `logits`: `prompt` tokens and the `output` counts by token.
    pub fn penalize(&self, logits: &mut [f32], prompt: &[i64], output: &BTreeMap<i64, u32>) {
        if self.repetition_penalty != 1.0 {
            let seen = prompt.iter().chain(output.keys());
            let mut done = std::collections::BTreeSet::new();
            for &t in seen {
                if let Some(l) = usize::try_from(t).ok().and_then(|i| logits.get_mut(i)) {
                    if done.insert(t) {
                        *l = if *l > 0.0 {
                            *l / self.repetition_penalty
                        } else {
                            *l * self.repetition_penalty
                        };
                    }
                }
            }
        }
        if self.frequency_penalty != 0.0 || self.presence_penalty != 0.0 {
            for (&t, &n) in output {
                if let Some(l) = usize::try_from(t).ok().and_then(|i| logits.get_mut(i)) {
                    *l -= self.frequency_penalty * n as f32 + self.presence_penalty;
                }
            }
        }
    }
}

/// A seeded sampler (SplitMix64).
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    state: u64,
}

/// The index of the largest value; ties go to the lower index.
pub fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best
}

impl Sampler {
    /// A sampler with `params`.
    pub fn new(params: SamplingParams) -> Self {
        let state = params.seed;
        Sampler { params, state }
    }

    fn next_f32(&mut self) -> f32 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Whether tokens are chosen by argmax (temperature 0).
    pub fn is_greedy(&self) -> bool {
        self.params.temperature <= 0.0
    }

    /// The tokens [`Sampler::sample`] may choose for `logits`, after temperature, min-p, top-k
    /// and top-p, with their probabilities; greedy gives the argmax alone. Where top-k or top-p
    /// choose, the kept tokens come most likely first (ties to the lower id); where every token
    /// is kept they come in id order. Only the head that top-k and top-p keep is ever sorted:
    /// sorting a whole vocabulary per token would cost more than the rest of a decode step's
    /// sampling.
    pub fn distribution(&self, logits: &[f32]) -> Distribution {
        if self.is_greedy() {
            return Distribution {
                probs: vec![(argmax(logits), 1.0)],
                mass: 1.0,
            };
        }
        let t = self.params.temperature;
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut probs: Vec<(usize, f32)> = logits
            .iter()
            .map(|&l| ((l - max) / t).exp())
            .enumerate()
            .collect();
        let sum: f32 = probs.iter().map(|p| p.1).sum();
        probs.iter_mut().for_each(|p| p.1 /= sum);
        let desc = |a: &(usize, f32), b: &(usize, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if self.params.min_p > 0.0 {
            // Relative to the most likely token, which top-k keeps: filtering first keeps the
            // same tokens.
            let top = probs.iter().map(|p| p.1).fold(0.0, f32::max);
            let floor = top * self.params.min_p;
            probs.retain(|p| p.1 >= floor);
        }
        let k = self.params.top_k;
        if k > 0 && k < probs.len() {
            probs.select_nth_unstable_by(k - 1, desc);
            probs.truncate(k);
        }
        if self.params.top_p >= 1.0 {
            if k > 0 {
                probs.sort_by(desc);
            }
            let mass = probs.iter().map(|p| p.1).sum();
            return Distribution { probs, mass };
        }
        // The smallest head, most likely first, whose mass reaches top_p: sort a head of `n`
        // tokens, growing it until it holds that mass.
        let mut n = probs.len().min(64);
        loop {
            if n < probs.len() {
                probs.select_nth_unstable_by(n - 1, desc);
            }
            probs[..n].sort_by(desc);
            let mut kept = 0;
            let mut mass = 0.0;
            for p in &probs[..n] {
                kept += 1;
                mass += p.1;
                if mass >= self.params.top_p {
                    break;
                }
            }
            if mass >= self.params.top_p || n == probs.len() {
                probs.truncate(kept);
                return Distribution { probs, mass };
            }
            n = (n * 4).min(probs.len());
        }
    }

    /// The next token for `logits`.
    pub fn sample(&mut self, logits: &[f32]) -> usize {
        if self.is_greedy() {
            return argmax(logits);
        }
        let d = self.distribution(logits);
        self.draw(&d)
    }

    /// A token drawn from `d`.
    pub fn draw(&mut self, d: &Distribution) -> usize {
        let r = self.next_f32() * d.mass;
        let mut acc = 0.0;
        for p in &d.probs {
            acc += p.1;
            if r < acc {
                return p.0;
            }
        }
        d.probs[d.probs.len() - 1].0
    }

    /// Speculative decoding's verification of `draft`, proposed by a draft that drew it from
    /// `q`, where the decoder's distribution is `p`: accepted with probability
    /// `min(1, p(draft) / q(draft))`; otherwise a token drawn from the residual
    /// `max(0, p − q)`, normalised. The token that comes out is distributed exactly as `p`.
    /// Returns the token and whether it is the draft's. Greedy accepts where the argmax (the
    /// whole of `p`) is the draft and draws nothing.
    pub fn verify(&mut self, p: &Distribution, q: &Distribution, draft: usize) -> (usize, bool) {
        let (pd, qd) = (p.prob(draft), q.prob(draft));
        if pd >= qd || (!self.is_greedy() && self.next_f32() * qd < pd) {
            return (draft, true);
        }
        let q_of: std::collections::HashMap<usize, f32> =
            q.probs.iter().map(|&(t, w)| (t, w / q.mass)).collect();
        let residual: Vec<(usize, f32)> = p
            .probs
            .iter()
            .map(|&(t, w)| (t, w / p.mass - q_of.get(&t).copied().unwrap_or(0.0)))
            .filter(|r| r.1 > 0.0)
            .collect();
        if residual.is_empty() {
            // p ≤ q everywhere means p = q: the draft was accepted above.
            return (self.draw(p), false);
        }
        let mass = residual.iter().map(|r| r.1).sum();
        let token = self.draw(&Distribution {
            probs: residual,
            mass,
        });
        (token, false)
    }
}

/// The tokens a sampler may choose, with unnormalised probabilities summing to `mass`.
#[derive(Clone, Debug, PartialEq)]
pub struct Distribution {
    /// `(token, weight)`: most likely first where top-k or top-p chose them, else in id order.
    pub probs: Vec<(usize, f32)>,
    /// The weights' sum.
    pub mass: f32,
}

impl Distribution {
    /// The probability of `token` (0 outside the support).
    pub fn prob(&self, token: usize) -> f32 {
        self.probs
            .iter()
            .find(|p| p.0 == token)
            .map_or(0.0, |p| p.1 / self.mass)
    }
}

/// Pearson's chi-square statistic of `observed` counts against `expected` probabilities (the
/// categories with a positive probability; a count where the probability is 0 makes it
/// infinite), and its degrees of freedom.
pub fn chi_square(observed: &[u64], expected: &[f64]) -> (f64, usize) {
    let n: u64 = observed.iter().sum();
    let mut stat = 0.0;
    let mut categories = 0usize;
    for (&o, &p) in observed.iter().zip(expected) {
        if p > 0.0 {
            let e = p * n as f64;
            stat += (o as f64 - e).powi(2) / e;
            categories += 1;
        } else if o > 0 {
            stat = f64::INFINITY;
        }
    }
    (stat, categories.saturating_sub(1))
}

/// The chi-square distribution's 99.9th percentile at `df` degrees of freedom
/// (Wilson–Hilferty), the value a correct sampler exceeds one time in a thousand.
pub fn chi_square_critical(df: usize) -> f64 {
    let k = df.max(1) as f64;
    let a = 2.0 / (9.0 * k);
    k * (1.0 - a + 3.0902 * a.sqrt()).powi(3)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verification_yields_the_decoders_distribution() {
        let p_logits = [2.0, 1.0, 0.5, -1.0, 0.0];
        let q_logits = [0.0, 1.5, 0.5, 1.0, -2.0];
        let params = SamplingParams {
            temperature: 1.0,
            seed: 11,
            ..Default::default()
        };
        let target = Sampler::new(params.clone());
        let mut verifier = Sampler::new(params.clone());
        // The draft samples from its top 3 only: q misses a token p can give.
        let mut draft = Sampler::new(SamplingParams {
            top_k: 3,
            seed: 12,
            ..params
        });
        let (p, q) = (
            target.distribution(&p_logits),
            draft.distribution(&q_logits),
        );
        assert_eq!(q.probs.len(), 3);
        let mut out = [0u64; 5];
        let mut proposed = [0u64; 5];
        let mut accepted = 0;
        for _ in 0..20_000 {
            let d = draft.draw(&q);
            proposed[d] += 1;
            let (t, ok) = verifier.verify(&p, &q, d);
            out[t] += 1;
            accepted += usize::from(ok);
        }
        let expected: Vec<f64> = (0..5).map(|t| f64::from(p.prob(t))).collect();
        let (stat, df) = chi_square(&out, &expected);
        assert!(
            stat < chi_square_critical(df),
            "chi2 {stat} over {df} df: {out:?}"
        );
        // The proposals alone are far from p: the test can tell the distributions apart.
        let (wrong, _) = chi_square(&proposed, &expected);
        assert!(wrong > 10.0 * chi_square_critical(df), "{wrong}");
        assert!(accepted > 5_000 && accepted < 20_000, "{accepted}");
    }

    #[test]
    fn greedy_verification_accepts_the_argmax_only() {
        let mut s = Sampler::new(SamplingParams::default());
        let p = s.distribution(&[0.1, 3.0, 2.0]);
        let q = s.distribution(&[0.1, 2.0, 3.0]);
        assert_eq!(s.verify(&p, &q, 2), (1, false));
        assert_eq!(s.verify(&p, &p, 1), (1, true));
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        assert_eq!(
            Sampler::new(SamplingParams::default()).sample(&[0.1, 3.0, 3.0, -1.0]),
            1
        );
    }

    #[test]
    fn sampling_is_reproducible_and_respects_top_p() {
        let logits = [2.0, 1.0, 0.5, -3.0];
        let params = SamplingParams {
            temperature: 1.0,
            top_p: 0.7,
            seed: 7,
            ..Default::default()
        };
        let a: Vec<usize> = {
            let mut s = Sampler::new(params.clone());
            (0..50).map(|_| s.sample(&logits)).collect()
        };
        let b: Vec<usize> = {
            let mut s = Sampler::new(params);
            (0..50).map(|_| s.sample(&logits)).collect()
        };
        assert_eq!(a, b);
        // p = softmax = [0.61, 0.22, 0.14, 0.003]: top-p 0.7 keeps tokens 0 and 1 only.
        assert!(a.iter().all(|&t| t <= 1) && a.contains(&0) && a.contains(&1));
    }

    #[test]
    fn top_k_min_p_and_penalties() {
        let logits = [2.0, 1.0, 0.5, -3.0];
        let sample = |p: SamplingParams| -> Vec<usize> {
            let mut s = Sampler::new(p);
            (0..200).map(|_| s.sample(&logits)).collect()
        };
        let base = SamplingParams {
            temperature: 1.0,
            seed: 3,
            ..Default::default()
        };
        let k1 = sample(SamplingParams {
            top_k: 1,
            ..base.clone()
        });
        assert!(k1.iter().all(|&t| t == 0));
        // min_p 0.3 of p0 = 0.61 keeps p >= 0.18: tokens 0 and 1.
        let mp = sample(SamplingParams {
            min_p: 0.3,
            ..base.clone()
        });
        assert!(mp.iter().all(|&t| t <= 1) && mp.contains(&1));

        let mut l = logits.to_vec();
        let out = BTreeMap::from([(0i64, 3u32), (2, 1)]);
        let p = SamplingParams {
            repetition_penalty: 2.0,
            frequency_penalty: 0.5,
            presence_penalty: 0.25,
            ..Default::default()
        };
        assert!(p.has_penalties());
        p.penalize(&mut l, &[3], &out);
        // token 0: 2/2 - 3·0.5 - 0.25; token 1 untouched; token 2: 0.5/2 - 0.5 - 0.25;
        // token 3 (prompt only): -3·2.
        assert_eq!(l, vec![-0.75, 1.0, -0.5, -6.0]);
    }

    /// The distribution as a whole-vocabulary sort gives it: the definition the partial
    /// selection in [`Sampler::distribution`] must keep.
    fn sorted_distribution(params: &SamplingParams, logits: &[f32]) -> Distribution {
        let t = params.temperature;
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut probs: Vec<(usize, f32)> = logits
            .iter()
            .map(|&l| ((l - max) / t).exp())
            .enumerate()
            .collect();
        let sum: f32 = probs.iter().map(|p| p.1).sum();
        probs.iter_mut().for_each(|p| p.1 /= sum);
        probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if params.top_k > 0 {
            probs.truncate(params.top_k);
        }
        if params.min_p > 0.0 {
            let floor = probs[0].1 * params.min_p;
            probs.retain(|p| p.1 >= floor);
        }
        if params.top_p < 1.0 {
            let (mut kept, mut mass) = (0, 0.0);
            for p in &probs {
                kept += 1;
                mass += p.1;
                if mass >= params.top_p {
                    break;
                }
            }
            probs.truncate(kept);
        }
        let mass = probs.iter().map(|p| p.1).sum();
        Distribution { probs, mass }
    }

    #[test]
    fn partial_selection_keeps_what_a_full_sort_keeps() {
        let mut state = 7u64;
        let mut next = || {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 40) as f32 / (1u64 << 24) as f32
        };
        for case in 0..40 {
            let vocab = [5, 300, 5000][case % 3];
            // Peaked and flat rows, with ties.
            let logits: Vec<f32> = (0..vocab)
                .map(|_| (next() * [2.0, 12.0][case % 2]).round() / 2.0)
                .collect();
            for (top_k, top_p, min_p) in [
                (0, 1.0, 0.0),
                (0, 0.9, 0.0),
                (0, 0.3, 0.0),
                (40, 1.0, 0.0),
                (40, 0.95, 0.0),
                (0, 1.0, 0.05),
                (3, 0.5, 0.1),
                (0, 0.999, 0.0),
            ] {
                let params = SamplingParams {
                    temperature: 0.7,
                    top_k,
                    top_p,
                    min_p,
                    ..Default::default()
                };
                let got = Sampler::new(params.clone()).distribution(&logits);
                let want = sorted_distribution(&params, &logits);
                let mut a = got.probs.clone();
                let mut b = want.probs.clone();
                if top_k > 0 || top_p < 1.0 {
                    assert_eq!(a, b, "order, case {case} {top_k} {top_p} {min_p}");
                }
                a.sort_by_key(|p| p.0);
                b.sort_by_key(|p| p.0);
                assert_eq!(a, b, "case {case} {top_k} {top_p} {min_p}");
                assert!((got.mass - want.mass).abs() < 1e-4, "case {case}");
            }
        }
    }
}
