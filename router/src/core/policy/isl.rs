//! The ISL rule: bypass short appends that are a small share of the prompt.

use protocol::Path;
use serde::{Deserialize, Serialize};

use super::{rules, ConditionalDisaggPolicy, PolicyInput, Verdict};

/// Bypass iff `eff_isl < eff_isl_tokens` and `eff_isl / ISL <
/// eff_isl_ratio`, where `eff_isl = ISL - min(decode_hit, ISL)` and
/// `decode_hit` is the tokens the chosen decode worker holds, a host or disk
/// block counting with its tier weight ([`PolicyInput::eff_isl_tokens`]):
/// Dynamo's `isl_bounding`. Both comparisons are strict: at a threshold the
/// request goes remote. A prompt shorter than
/// `min_remote_isl` bypasses whatever it reuses.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct IslBased {
    /// Longest append (uncached tokens) still prefilled locally is one less.
    /// Default 2048: appends of a few hundred tokens slow co-running decodes
    /// by about 2%, a 1k-token prefill by about 48% (see the reference).
    pub eff_isl_tokens: u32,
    /// Largest uncached share of the prompt still prefilled locally (strict).
    /// Default 0.7.
    pub eff_isl_ratio: f64,
    /// Prompts shorter than this are prefilled on the decode worker however
    /// little of them it holds: a short cold prompt costs less there than a
    /// remote prefill and a KV transfer (llm-d's `promptTokens`). Default 0:
    /// the rule above alone, as Dynamo's `isl_bounding`.
    pub min_remote_isl: u32,
}

impl Default for IslBased {
    fn default() -> Self {
        Self {
            eff_isl_tokens: 2048,
            eff_isl_ratio: 0.7,
            min_remote_isl: 0,
        }
    }
}

/// The numbers of the ISL rule.
pub(super) struct IslCheck {
    /// The effective ISL (weighted uncached tokens).
    append: f64,
    ratio: f64,
    short: bool,
    small: bool,
    /// The whole prompt is below `min_remote_isl`.
    tiny: bool,
}

impl IslCheck {
    /// Whether the rule bypasses.
    pub(super) fn bypass(&self) -> bool {
        self.tiny || (self.short && self.small)
    }
}

impl IslBased {
    pub(super) fn check(&self, input: &PolicyInput<'_>) -> IslCheck {
        let append = input.eff_isl_tokens();
        let ratio = append / f64::from(input.isl_tokens.max(1));
        IslCheck {
            append,
            ratio,
            short: append < f64::from(self.eff_isl_tokens),
            small: ratio < self.eff_isl_ratio,
            tiny: input.isl_tokens < self.min_remote_isl,
        }
    }

    pub(super) fn clause(
        &self,
        c: &IslCheck,
        input: &PolicyInput<'_>,
    ) -> (Path, &'static str, String) {
        let (isl, hit) = (
            input.isl_tokens,
            input.decode.held.any().min(input.isl_tokens),
        );
        if c.tiny {
            let text = format!(
                "prompt of {isl} tokens < {}: bypass on {} (local prefill of {} tokens)",
                self.min_remote_isl,
                input.decode.id,
                input.decode_append_tokens()
            );
            (Path::Bypass, rules::ISL_SHORT_PROMPT, text)
        } else if c.short && c.small {
            let text = format!(
                "append of {} uncached tokens < {} and {}/{} = {:.2} < {:.2}: bypass on {} which holds {} tokens",
                c.append, self.eff_isl_tokens, c.append, isl, c.ratio, self.eff_isl_ratio, input.decode.id, hit
            );
            (Path::Bypass, rules::ISL_SHORT_APPEND, text)
        } else if !c.short {
            let text = format!(
                "append of {} uncached tokens >= {} ({} holds {} of {}): remote prefill on {}",
                c.append, self.eff_isl_tokens, input.decode.id, hit, isl, input.prefill.id
            );
            (Path::Remote, rules::ISL_LONG_PREFILL, text)
        } else {
            let text = format!(
                "append of {} < {} tokens but {}/{} = {:.2} >= {:.2} ({} holds {}): remote prefill on {}",
                c.append,
                self.eff_isl_tokens,
                c.append,
                isl,
                c.ratio,
                self.eff_isl_ratio,
                input.decode.id,
                hit,
                input.prefill.id
            );
            (Path::Remote, rules::ISL_LOW_REUSE, text)
        }
    }
}

impl ConditionalDisaggPolicy for IslBased {
    fn decide(&self, input: &PolicyInput<'_>) -> Verdict {
        let (path, rule, reason) = self.clause(&self.check(input), input);
        Verdict::new(path, rule, reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::policy::tests::Fixture;
    use crate::core::workers::EffectiveLoad;

    #[test]
    fn isl_rule_at_and_around_its_thresholds() {
        let f = Fixture::new();
        let policy = IslBased::default(); // 2048 tokens, 0.7
        let idle = EffectiveLoad::default();
        // (isl, decode hit, expected path, rule)
        let table = [
            // token threshold: append 2047 / 2048 / 2049 of a 10 000 prompt
            (10_000, 7_953, Path::Bypass, rules::ISL_SHORT_APPEND),
            (10_000, 7_952, Path::Remote, rules::ISL_LONG_PREFILL),
            (10_000, 7_951, Path::Remote, rules::ISL_LONG_PREFILL),
            // ratio threshold: append 699 / 700 / 701 of a 1000 prompt
            (1_000, 301, Path::Bypass, rules::ISL_SHORT_APPEND),
            (1_000, 300, Path::Remote, rules::ISL_LOW_REUSE),
            (1_000, 299, Path::Remote, rules::ISL_LOW_REUSE),
            // cold short prompt: ratio 1.0
            (100, 0, Path::Remote, rules::ISL_LOW_REUSE),
            // fully cached
            (5_000, 5_000, Path::Bypass, rules::ISL_SHORT_APPEND),
            // hit beyond the prompt is capped
            (5_000, 9_000, Path::Bypass, rules::ISL_SHORT_APPEND),
        ];
        for (isl, hit, path, rule) in table {
            let v = policy.decide(&f.input(isl, hit, idle, idle));
            assert_eq!(
                (v.path, v.rule),
                (path, rule),
                "isl {isl} hit {hit}: {}",
                v.reason
            );
        }
        // A short prompt bypasses whatever it reuses, when asked to.
        let tiny = IslBased {
            min_remote_isl: 256,
            ..IslBased::default()
        };
        for (isl, path, rule) in [
            (255, Path::Bypass, rules::ISL_SHORT_PROMPT),
            (256, Path::Remote, rules::ISL_LOW_REUSE),
        ] {
            let v = tiny.decide(&f.input(isl, 0, idle, idle));
            assert_eq!((v.path, v.rule), (path, rule), "{}", v.reason);
        }
        // Dynamo's eff_isl: host and disk blocks count with their tier
        // weight (0.5, 0.25), unrounded. 6000 on the device and 2000 more in
        // host memory of 10 000: eff_isl = 10 000 - 7000 = 3000 >= 2048.
        let mut input = f.input(10_000, 6_000, idle, idle);
        input.decode.held.host = 8_000;
        input.decode.held.disk = 8_000;
        assert_eq!(input.eff_isl_tokens(), 3_000.0);
        let v = policy.decide(&input);
        assert_eq!((v.path, v.rule), (Path::Remote, rules::ISL_LONG_PREFILL));
        // At host weight 0.98: 10 000 - 6000 - 0.98 × 2000 = 2040 < 2048:
        // bypass; at 0.9737, 2052.6 >= 2048: remote.
        input.tier_weights.host = 0.98;
        let v = policy.decide(&input);
        assert_eq!((v.path, v.rule), (Path::Bypass, rules::ISL_SHORT_APPEND));
        input.tier_weights.host = 0.9737;
        assert!((input.eff_isl_tokens() - 2_052.6).abs() < 1e-6);
        let v = policy.decide(&input);
        assert_eq!(
            v.path,
            Path::Remote,
            "not rounded to whole blocks: {}",
            v.reason
        );
        let v = policy.decide(&f.input(8_500, 8_188, idle, idle));
        assert_eq!(
            v.reason,
            "append of 312 uncached tokens < 2048 and 312/8500 = 0.04 < 0.70: bypass on d0 which holds 8188 tokens"
        );
    }
}
