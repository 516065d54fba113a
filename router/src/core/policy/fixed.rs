//! The two fixed policies: always remote (plain disaggregation) and never
//! remote (aggregated serving).

use protocol::Path;
use serde::{Deserialize, Serialize};

use super::{rules, ConditionalDisaggPolicy, PolicyInput, Verdict};

/// Remote prefill whenever a prefill worker exists (plain disaggregation).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct AlwaysDisagg;

impl ConditionalDisaggPolicy for AlwaysDisagg {
    fn decide(&self, input: &PolicyInput<'_>) -> Verdict {
        Verdict::new(
            Path::Remote,
            rules::ALWAYS_REMOTE,
            format!(
                "always disaggregated: remote prefill of {} tokens on {} ({} cached there), decode on {}",
                input.isl_tokens, input.prefill.id, input.prefill.held.any(), input.decode.id
            ),
        )
    }
}

/// Always bypass: every request is prefilled on its decode worker
/// (aggregated serving).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct NeverDisagg;

impl ConditionalDisaggPolicy for NeverDisagg {
    fn decide(&self, input: &PolicyInput<'_>) -> Verdict {
        Verdict::new(
            Path::Bypass,
            rules::NEVER_BYPASS,
            format!(
                "never disaggregated: bypass on {}, local prefill of {} of {} tokens",
                input.decode.id,
                input.decode_append_tokens(),
                input.isl_tokens
            ),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::policy::tests::Fixture;
    use crate::core::workers::EffectiveLoad;

    #[test]
    fn always_and_never() {
        let f = Fixture::new();
        let idle = EffectiveLoad::default();
        let input = f.input(100, 100, idle, idle);
        assert_eq!(AlwaysDisagg.decide(&input).path, Path::Remote);
        assert_eq!(NeverDisagg.decide(&input).path, Path::Bypass);
        let input = f.input(100_000, 0, idle, idle);
        assert_eq!(AlwaysDisagg.decide(&input).rule, rules::ALWAYS_REMOTE);
        assert_eq!(NeverDisagg.decide(&input).rule, rules::NEVER_BYPASS);
    }
}
