//! The third path's settings and the option it offers a policy: a remote
//! prefill whose prefill worker first pulls the prefix a decode worker
//! holds (D -> P, [`protocol::Path::RemoteFetch`]), prefills only the rest
//! and hands its KV to the decode worker as a plain remote prefill does.
//!
//! The router offers it ([`offer`]) when it is enabled, the prompt's best
//! holder is a decode worker, and that worker holds at least `min_tokens`
//! more of the prompt on its device than the chosen prefill worker does.
//! [`crate::SlaDynamic`] weighs it as its third option; for every other
//! policy a remote verdict (or a gate veto) with an offer on the table
//! fetches (the static rule: pulling KV is cheaper than recomputing it).

use serde::{Deserialize, Serialize};

use super::policy::Candidate;
use super::select::Side;

/// Whether and when the router fetches a prefix from a decode worker.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FetchConfig {
    /// Offer the third path at all. Default false: a real engine needs
    /// vLLM's bidirectional NIXL transfer (see the README) on every worker.
    pub enabled: bool,
    /// Fewest tokens worth pulling (fewer are recomputed on the prefill
    /// worker). Default 1024.
    pub min_tokens: u32,
}

impl Default for FetchConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            min_tokens: 1024,
        }
    }
}

/// A prefix a prefill worker could pull before it prefills.
#[derive(Debug, Clone, Copy)]
pub struct FetchOption<'a> {
    /// The decode worker that holds it (and would serve the read).
    pub source: Candidate<'a>,
    /// Leading prompt tokens the source holds on its device, in whole
    /// blocks, short of the prompt's last token (which is computed: its
    /// logits give the first output token).
    pub prefix_tokens: u32,
    /// What the prefill worker lacks of it.
    pub pulled_tokens: u32,
}

/// The fetch the router can offer for a prompt of `isl` tokens of blocks of
/// `block_size`, from the best `holder` (on `side`) to the chosen
/// `prefill` worker; `None` when disabled, when the holder is not a decode
/// worker, or when it holds fewer than `min_tokens` tokens the prefill
/// worker lacks.
pub fn offer<'a>(
    config: &FetchConfig,
    isl: u32,
    block_size: u32,
    holder: Option<(Side, Candidate<'a>)>,
    prefill: &Candidate<'_>,
) -> Option<FetchOption<'a>> {
    if !config.enabled {
        return None;
    }
    let (Side::Decode, source) = holder? else {
        return None;
    };
    let bs = block_size.max(1);
    let whole = (isl.saturating_sub(1) / bs) * bs;
    let prefix_tokens = (source.held.device / bs * bs).min(whole);
    let pulled_tokens = prefix_tokens.checked_sub(prefill.held.any())?;
    (pulled_tokens > 0 && pulled_tokens >= config.min_tokens).then_some(FetchOption {
        source,
        prefix_tokens,
        pulled_tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::policy::tests::{load, Fixture};
    use crate::core::policy::HeldTokens;

    fn held(tokens: u32) -> HeldTokens {
        HeldTokens {
            device: tokens,
            host: tokens,
            disk: tokens,
        }
    }

    #[test]
    fn a_decode_holder_with_enough_to_pull_is_offered() {
        let f = Fixture::new();
        let input = f.input(10_000, 9_000, load(0, 0), load(0, 0));
        let on = FetchConfig {
            enabled: true,
            ..FetchConfig::default()
        };
        let mut p = input.prefill;
        p.held = held(2_000);
        let got = offer(&on, 10_000, 16, Some((Side::Decode, input.decode)), &p).unwrap();
        assert_eq!(got.source.id, input.decode.id);
        assert_eq!(
            (got.prefix_tokens, got.pulled_tokens),
            (9_000 / 16 * 16, 8_992 - 2_000)
        );
        // Off by default; a prefill holder is not a source; too little to pull.
        let dflt = FetchConfig::default();
        assert!(offer(&dflt, 10_000, 16, Some((Side::Decode, input.decode)), &p).is_none());
        assert!(offer(&on, 10_000, 16, Some((Side::Prefill, input.decode)), &p).is_none());
        p.held = held(8_500);
        assert!(offer(&on, 10_000, 16, Some((Side::Decode, input.decode)), &p).is_none());
        assert!(offer(&on, 10_000, 16, None, &p).is_none());
    }

    /// A holder of the whole prompt supplies all but the last block: the
    /// prefill worker computes the last token.
    #[test]
    fn the_last_token_is_always_computed() {
        let f = Fixture::new();
        let input = f.input(4_096, 4_096, load(0, 0), load(0, 0));
        let on = FetchConfig {
            enabled: true,
            min_tokens: 1,
        };
        let got = offer(
            &on,
            4_096,
            16,
            Some((Side::Decode, input.decode)),
            &input.prefill,
        )
        .unwrap();
        assert_eq!(got.prefix_tokens, 4_080);
    }
}
