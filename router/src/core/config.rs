//! The router core's configuration: the hashing contract, selection, the
//! decode gate, the ledger's timing and the third path (fetch), with their defaults (`Default`) and
//! range checks; and the settings recorded with every decision.

use protocol::hash::ZeroBlockSize;
use protocol::HashingContract;

use super::fetch::FetchConfig;
use super::gate::GateConfig;
use super::policy::ParamError;
use super::select::{DecodeSelection, PrefillSelection};
use super::session::SessionConfig;
use super::workers::LedgerConfig;

/// Settings added after the decision log began, each with the value that
/// decides as the router did before it existed: a record that does not
/// name one was made without it, and replay gives it this value.
pub const UNRECORDED_PARAMS: &[(&str, f64)] =
    &[("prefill.miss_weight", 0.0), ("decode.offer_holder", 0.0)];

/// Router settings `sim tune` searches for every family of deployments
/// (aggregated and disaggregated too: they choose decode workers the same
/// way), each with its grid, the default first.
///
/// `decode.overlap_credit` is Dynamo's `--kv-overlap-score-weight`
/// (default 1); on multi-turn workloads a conversation's decode worker is
/// worth more than one block of load per cached block to every family
/// (the README's tuning section has the figures).
pub const TUNED_PARAMS: &[(&str, &[f64])] =
    &[("decode.overlap_credit", &[1.0, 2.0, 4.0, 8.0, 16.0])];

/// Everything the router core is configured with.
#[derive(Debug, Clone, PartialEq)]
pub struct RouterConfig {
    /// How blocks are named; workers must register the same contract.
    pub contract: HashingContract,
    /// Decode-worker selection.
    pub decode: DecodeSelection,
    /// Prefill-worker selection.
    pub prefill: PrefillSelection,
    /// The decode gate.
    pub gate: GateConfig,
    /// The in-flight ledger's timing.
    pub ledger: LedgerConfig,
    /// The third path: prefixes fetched from decode workers.
    pub fetch: FetchConfig,
    /// Session affinity.
    pub session: SessionConfig,
}

impl RouterConfig {
    /// The defaults for a contract.
    pub fn new(contract: HashingContract) -> Self {
        Self {
            contract,
            decode: DecodeSelection::default(),
            prefill: PrefillSelection::default(),
            gate: GateConfig::default(),
            ledger: LedgerConfig::default(),
            fetch: FetchConfig::default(),
            session: SessionConfig::default(),
        }
    }

    /// Checks every setting: each recorded one is a finite number `>= 0`,
    /// the gate's budget `> 0`, the block size `> 0`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let out_of_range = |field, value, expected| ConfigError::OutOfRange {
            field,
            value,
            expected,
        };
        for (field, value) in self.params() {
            if !(value.is_finite() && value >= 0.0) {
                return Err(out_of_range(field, value, "a finite number >= 0"));
            }
        }
        let budget = self.gate.budget_fraction;
        if budget <= 0.0 {
            return Err(out_of_range(
                "gate.budget_fraction",
                budget,
                "a finite number > 0",
            ));
        }
        self.contract.hasher()?;
        Ok(())
    }

    /// The selection and gate settings, by name (recorded with every
    /// decision; the contract and ledger timing are not decision inputs).
    pub fn params(&self) -> Vec<(&'static str, f64)> {
        let bool_f = |b: bool| if b { 1.0 } else { 0.0 };
        vec![
            ("decode.overlap_credit", self.decode.overlap_credit),
            ("decode.host_weight", self.decode.tier_weights.host),
            ("decode.disk_weight", self.decode.tier_weights.disk),
            ("decode.queue_weight", self.decode.queue_weight),
            ("decode.busy_kv_usage", self.decode.busy_kv_usage),
            ("decode.busy_waiting", f64::from(self.decode.busy_waiting)),
            ("decode.temperature", self.decode.temperature),
            ("decode.offer_holder", bool_f(self.decode.offer_holder)),
            ("prefill.host_weight", self.prefill.tier_weights.host),
            ("prefill.disk_weight", self.prefill.tier_weights.disk),
            ("prefill.miss_weight", self.prefill.miss_weight),
            ("prefill.temperature", self.prefill.temperature),
            ("gate.enabled", bool_f(self.gate.enabled)),
            ("gate.budget_fraction", self.gate.budget_fraction),
            (
                "gate.count_reservations",
                bool_f(self.gate.count_reservations),
            ),
            ("fetch.enabled", bool_f(self.fetch.enabled)),
            ("fetch.min_tokens", f64::from(self.fetch.min_tokens)),
            ("session.enabled", bool_f(self.session.enabled)),
        ]
    }

    /// Sets one of [`RouterConfig::params`].
    pub fn set_param(&mut self, name: &str, value: f64) -> Result<(), ParamError> {
        match name {
            "decode.overlap_credit" => self.decode.overlap_credit = value,
            "decode.host_weight" => self.decode.tier_weights.host = value,
            "decode.disk_weight" => self.decode.tier_weights.disk = value,
            "decode.queue_weight" => self.decode.queue_weight = value,
            "decode.busy_kv_usage" => self.decode.busy_kv_usage = value,
            "decode.busy_waiting" => self.decode.busy_waiting = value as u32,
            "decode.temperature" => self.decode.temperature = value,
            "decode.offer_holder" => self.decode.offer_holder = value != 0.0,
            "prefill.host_weight" => self.prefill.tier_weights.host = value,
            "prefill.disk_weight" => self.prefill.tier_weights.disk = value,
            "prefill.miss_weight" => self.prefill.miss_weight = value,
            "prefill.temperature" => self.prefill.temperature = value,
            "gate.enabled" => self.gate.enabled = value != 0.0,
            "gate.budget_fraction" => self.gate.budget_fraction = value,
            "gate.count_reservations" => self.gate.count_reservations = value != 0.0,
            "fetch.enabled" => self.fetch.enabled = value != 0.0,
            "fetch.min_tokens" => self.fetch.min_tokens = value as u32,
            "session.enabled" => self.session.enabled = value != 0.0,
            other => return Err(ParamError::UnknownRouterParam(other.to_owned())),
        }
        Ok(())
    }
}

/// Why a configuration is refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// The contract's block size is zero.
    #[error(transparent)]
    ZeroBlockSize(#[from] ZeroBlockSize),
    /// The policy's parameters are out of range.
    #[error(transparent)]
    Policy(#[from] ParamError),
    /// A numeric setting is out of range.
    #[error("{field} = {value} is out of range: expected {expected}")]
    OutOfRange {
        /// The setting.
        field: &'static str,
        /// Its value.
        value: f64,
        /// What it must be.
        expected: &'static str,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `sim tune` starts each family at the first value of each grid: the
    /// router's default, so that the untuned candidate is the default one.
    #[test]
    fn each_tuned_grid_starts_at_the_default() {
        let config = RouterConfig::new(HashingContract::for_model("m", 16));
        let params = config.params();
        for (name, grid) in TUNED_PARAMS {
            let default = params.iter().find(|(n, _)| n == name).map(|p| p.1);
            assert_eq!(default, grid.first().copied(), "{name}");
        }
    }
}
