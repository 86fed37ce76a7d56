//! Choosing the next token from logits: greedy, or temperature and top-p sampling with a seeded
//! generator (the same seed gives the same tokens).

/// How tokens are chosen.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax, ties to the lower id).
    pub temperature: f32,
    /// Nucleus: sample among the most likely tokens whose probabilities sum to at least this.
    pub top_p: f32,
    /// Seed of the generator.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
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

    /// The next token for `logits`.
    pub fn sample(&mut self, logits: &[f32]) -> usize {
        if self.params.temperature <= 0.0 {
            return argmax(logits);
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
        probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let mut kept = 0;
        let mut mass = 0.0;
        for p in &probs {
            kept += 1;
            mass += p.1;
            if mass >= self.params.top_p {
                break;
            }
        }
        let r = self.next_f32() * mass;
        let mut acc = 0.0;
        for p in &probs[..kept] {
            acc += p.1;
            if r < acc {
                return p.0;
            }
        }
        probs[kept - 1].0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
