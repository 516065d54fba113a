//! The one home of the router's policies: each one's name, its parameters
//! with their help (the defaults are the policy's own `Default`), the
//! spellings earlier releases accepted, and how it is built from a name and
//! parameters — from flags, a config file, a decision record or a what-if.
//!
//! Adding a parameter to a policy is a field of the policy (with its
//! default) and one [`ParamSpec`] line in [`POLICIES`]; the flags, the
//! config file, the decision log, `replay` and the simulator all go through
//! here. A parameter is a number: it is recorded with every decision as
//! `(name, f64)`; one whose default is a whole number takes whole numbers
//! only. Every parameter is a finite number `>= 0`; a policy with stricter
//! ranges says so in its `validate`.

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

use super::{
    AlwaysDisagg, ConditionalDisaggPolicy, IslBased, IslOrLoad, LoadBased, NeverDisagg,
    PolicyInput, SlaDynamic, Verdict,
};

/// One parameter of a policy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ParamSpec {
    /// Its name: the flag `--eff-isl-tokens`, the file key
    /// `[policy] eff_isl_tokens`, the decision record's name.
    pub name: &'static str,
    /// What it does, for `--help` (the default is added from the policy's
    /// `Default`).
    pub help: &'static str,
    /// The values `sim tune` tries for it (the default is tried too); empty
    /// for a parameter that is not a threshold to tune (the SLA policy's
    /// targets are the SLO, its cost model a prior the router core's
    /// calibration corrects online).
    pub tune: &'static [f64],
}

/// One policy: its name, what it does, its parameters.
#[derive(Debug)]
pub struct PolicySpec {
    /// The one spelling: flags, files, decision records, `replay`, `sim`.
    pub name: &'static str,
    /// One line on what it decides.
    pub about: &'static str,
    /// Its parameters in groups (a rule's parameters are one group, which
    /// a policy combining rules shares), in the order they are shown and
    /// recorded.
    params: &'static [&'static [ParamSpec]],
    /// Other names earlier releases accepted (besides the name with `-` for
    /// `_` or in another case): still accepted, with a deprecation warning.
    pub aliases: &'static [&'static str],
    /// NVIDIA Dynamo's name for the same policy (same decisions), accepted
    /// like the name itself, without a deprecation note, so that a Dynamo
    /// configuration carries over.
    pub dynamo: Option<&'static str>,
    default: fn() -> Policy,
    from_value: fn(Value) -> Result<Policy, serde_json::Error>,
}

const ISL_PARAMS: [ParamSpec; 3] = [
    ParamSpec {
        name: "eff_isl_tokens",
        help: "ISL rule: an append of fewer uncached tokens than this may be prefilled on the decode worker (strict <)",
        tune: &[512.0, 1024.0, 4096.0, 8192.0],
    },
    ParamSpec {
        name: "eff_isl_ratio",
        help: "ISL rule: ... if the uncached share of the prompt is also below this (strict <)",
        tune: &[0.5, 0.9],
    },
    ParamSpec {
        name: "min_remote_isl",
        help: "ISL rule: a prompt shorter than this is prefilled on the decode worker whatever it reuses (0: never)",
        tune: &[512.0, 2048.0],
    },
];

const LOAD_PARAMS: [ParamSpec; 2] = [
    ParamSpec {
        name: "prefill_busy",
        help: "Load rule: a prefill worker with more queued prefill tokens than this many max-size steps is busy",
        tune: &[0.5, 1.0, 4.0, 8.0],
    },
    ParamSpec {
        name: "decode_busy",
        help: "Load rule: a decode worker at this KV usage or more is too busy to prefill",
        tune: &[0.6, 0.7, 0.9],
    },
];

const SLA_PARAMS: [ParamSpec; 14] = [
    ParamSpec {
        name: "ttft_target_ms",
        help: "SLA policy: time-to-first-token target (ms)",
        tune: &[],
    },
    ParamSpec {
        name: "itl_target_ms",
        help: "SLA policy: inter-token latency target, a per-request mean (ms)",
        tune: &[],
    },
    ParamSpec {
        name: "spare_decodes_up_to",
        help: "SLA policy, a multiple of the TTFT target: when neither path meets the targets, a request goes to the prefill worker to spare the decode worker's running requests only while its predicted first token there is within this multiple of the target, past which the sooner first token wins (0: no limit; 1 or less: never spare them; a limit bounds the prefill side's queue but costs attainment: README, 'A limit on the prefill queue')",
        tune: &[],
    },
    ParamSpec {
        name: "prefill_c0_ms",
        help: "SLA cost model (a prior, corrected online by calibration): fixed cost of a prefill step (ms)",
        tune: &[],
    },
    ParamSpec {
        name: "prefill_c1_ms",
        help: "SLA cost model: cost per new prompt token (ms)",
        tune: &[],
    },
    ParamSpec {
        name: "prefill_c2_ms",
        help: "SLA cost model: attention cost per new token per attended token (ms)",
        tune: &[],
    },
    ParamSpec {
        name: "decode_t0_ms",
        help: "SLA cost model: fixed cost of a decode step (ms)",
        tune: &[],
    },
    ParamSpec {
        name: "decode_per_seq_ms",
        help: "SLA cost model: decode step cost per sequence in the batch (ms)",
        tune: &[],
    },
    ParamSpec {
        name: "decode_per_ctx_token_ms",
        help: "SLA cost model: decode step cost per context token of the batch (ms)",
        tune: &[],
    },
    ParamSpec {
        name: "transfer_setup_ms",
        help: "SLA cost model: fixed cost of one KV transfer (ms)",
        tune: &[],
    },
    ParamSpec {
        name: "transfer_bytes_per_ms",
        help: "SLA cost model: KV transfer bandwidth (bytes per ms)",
        tune: &[],
    },
    ParamSpec {
        name: "read_step_overhead",
        help: "SLA cost model: share by which a decode worker's steps are longer while it serves a prefix read (the third path; an assumption)",
        tune: &[],
    },
    ParamSpec {
        name: "host_read_setup_ms",
        help: "SLA cost model: fixed cost of reading a held prefix back from a worker's host memory (ms)",
        tune: &[],
    },
    ParamSpec {
        name: "host_read_bytes_per_ms",
        help: "SLA cost model: host link (PCIe) bandwidth per GPU for a host-held prefix's read-back (bytes per ms; an assumption)",
        tune: &[],
    },
];

/// Every policy, in the order `--help` lists them.
pub static POLICIES: [PolicySpec; 6] = [
    PolicySpec {
        name: "always_disagg",
        about: "remote prefill whenever a prefill worker exists (plain disaggregation)",
        params: &[],
        aliases: &["disagg", "disaggregated"],
        dynamo: None,
        default: || Policy::AlwaysDisagg(AlwaysDisagg),
        from_value: |v| serde_json::from_value(v).map(Policy::AlwaysDisagg),
    },
    PolicySpec {
        name: "never_disagg",
        about: "always bypass: prefill on the decode worker (aggregated serving)",
        params: &[],
        aliases: &["aggregated", "agg"],
        dynamo: None,
        default: || Policy::NeverDisagg(NeverDisagg),
        from_value: |v| serde_json::from_value(v).map(Policy::NeverDisagg),
    },
    PolicySpec {
        name: "isl",
        about: "bypass short appends that are a small share of the prompt",
        params: &[&ISL_PARAMS],
        aliases: &[],
        dynamo: Some("isl_bounding"),
        default: || Policy::Isl(IslBased::default()),
        from_value: |v| serde_json::from_value(v).map(Policy::Isl),
    },
    PolicySpec {
        name: "load",
        about: "bypass while the prefill worker is busy and the decode worker is not",
        params: &[&LOAD_PARAMS],
        aliases: &[],
        dynamo: Some("prefill_load"),
        default: || Policy::Load(LoadBased::default()),
        from_value: |v| serde_json::from_value(v).map(Policy::Load),
    },
    PolicySpec {
        name: "isl_or_load",
        about: "bypass when the ISL rule or the load rule does (the default)",
        params: &[&ISL_PARAMS, &LOAD_PARAMS],
        aliases: &[],
        dynamo: Some("isl_or_load"),
        default: || Policy::IslOrLoad(IslOrLoad::default()),
        from_value: |v| serde_json::from_value(v).map(Policy::IslOrLoad),
    },
    PolicySpec {
        name: "sla_dynamic",
        about: "predict TTFT of each path (local; remote; remote with the prefix fetched from the decode worker, when enabled) and the ITL a local prefill inflicts, calibrated online; keep the most requests within the SLO (set only the targets)",
        params: &[&SLA_PARAMS],
        aliases: &["sla"],
        dynamo: None,
        default: || Policy::SlaDynamic(SlaDynamic::default()),
        from_value: |v| serde_json::from_value(v).map(Policy::SlaDynamic),
    },
];

/// A policy's name, or a parameter, that cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ParamError {
    #[error("unknown policy {name:?} (known: {known})")]
    UnknownPolicy { name: String, known: String },
    #[error("policy {policy} has no parameter {name:?} (it has: {known})")]
    UnknownParam {
        policy: &'static str,
        name: String,
        known: String,
    },
    #[error("{name} = {value}: expected {expected}")]
    OutOfRange {
        name: String,
        value: f64,
        expected: &'static str,
    },
    #[error("the router has no setting {0:?}")]
    UnknownRouterParam(String),
}

/// A policy found by name.
#[derive(Debug, Clone, Copy)]
pub struct PolicyName {
    /// The policy.
    pub spec: &'static PolicySpec,
    /// The name was spelled as an earlier release did (an alias, `-` for
    /// `_`, another case): this is the spelling given; say it is
    /// deprecated.
    pub deprecated: bool,
}

impl PolicySpec {
    /// Finds a policy by its name, or by a spelling earlier releases
    /// accepted (then [`PolicyName::deprecated`]).
    pub fn find(name: &str) -> Result<PolicyName, ParamError> {
        if let Some(spec) = POLICIES
            .iter()
            .find(|s| s.name == name || s.dynamo == Some(name))
        {
            return Ok(PolicyName {
                spec,
                deprecated: false,
            });
        }
        let normal = name.trim().to_ascii_lowercase().replace('-', "_");
        POLICIES
            .iter()
            .find(|s| s.name == normal || s.aliases.contains(&normal.as_str()))
            .map(|spec| PolicyName {
                spec,
                deprecated: true,
            })
            .ok_or_else(|| ParamError::UnknownPolicy {
                name: name.to_owned(),
                known: POLICIES
                    .iter()
                    .map(|s| s.name)
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }

    /// The policy with its default parameters.
    pub fn default_policy(&self) -> Policy {
        (self.default)()
    }

    /// Its parameters, in the order they are shown and recorded.
    pub fn params(&self) -> impl Iterator<Item = &'static ParamSpec> {
        self.params.iter().flat_map(|group| group.iter())
    }

    /// The parameter `name`, if the policy has it.
    pub fn param(&self, name: &str) -> Option<&'static ParamSpec> {
        self.params().find(|p| p.name == name)
    }

    fn unknown_param(&'static self, name: &str) -> ParamError {
        ParamError::UnknownParam {
            policy: self.name,
            name: name.to_owned(),
            known: match self.params().map(|p| p.name).collect::<Vec<_>>() {
                names if names.is_empty() => "none".to_owned(),
                names => names.join(", "),
            },
        }
    }
}

/// `name=value`, a parameter as tools take it (`--param eff_isl_tokens=1024`).
pub fn parse_param(text: &str) -> Result<(String, f64), String> {
    let (name, value) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?} is not NAME=VALUE"))?;
    let value = value
        .trim()
        .parse()
        .map_err(|_| format!("{value:?} is not a number"))?;
    Ok((name.trim().to_owned(), value))
}

/// Every policy the router can run, with its parameters.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Policy {
    AlwaysDisagg(AlwaysDisagg),
    NeverDisagg(NeverDisagg),
    Isl(IslBased),
    Load(LoadBased),
    IslOrLoad(IslOrLoad),
    SlaDynamic(SlaDynamic),
}

impl Default for Policy {
    /// ISL-or-load with its defaults.
    fn default() -> Self {
        Policy::IslOrLoad(IslOrLoad::default())
    }
}

impl Policy {
    /// A policy by name (or an earlier spelling) with `params` set over its
    /// defaults, checked: what a decision record, `replay --policy` and the
    /// simulator build.
    pub fn with_params<'a>(
        name: &str,
        params: impl IntoIterator<Item = (&'a str, f64)>,
    ) -> Result<Policy, ParamError> {
        let mut policy = PolicySpec::find(name)?.spec.default_policy();
        for (name, value) in params {
            policy.set(name, value)?;
        }
        policy.validate()?;
        Ok(policy)
    }

    /// Its registry entry.
    pub fn spec(&self) -> &'static PolicySpec {
        let name = match self {
            Policy::AlwaysDisagg(_) => "always_disagg",
            Policy::NeverDisagg(_) => "never_disagg",
            Policy::Isl(_) => "isl",
            Policy::Load(_) => "load",
            Policy::IslOrLoad(_) => "isl_or_load",
            Policy::SlaDynamic(_) => "sla_dynamic",
        };
        POLICIES
            .iter()
            .find(|s| s.name == name)
            .expect("every variant is in POLICIES")
    }

    /// Its name, recorded with every decision.
    pub fn name(&self) -> &'static str {
        self.spec().name
    }

    /// Whether it weighs the alternatives the router offers itself: the
    /// third path's fetch ([`PolicyInput::fetch`]) as a path of its own,
    /// and the decode holder ([`PolicyInput::decode_holder`]) as where a
    /// bypass may run. The static policies keep Dynamo's semantics: a
    /// remote verdict of theirs fetches whatever is offered, and they are
    /// offered no holder.
    pub fn weighs_alternatives(&self) -> bool {
        matches!(self, Policy::SlaDynamic(_))
    }

    /// Its parameters as (name, value), in the registry's order: recorded
    /// with every decision, logged at start.
    pub fn params(&self) -> Vec<(&'static str, f64)> {
        let value = self.to_value();
        self.spec()
            .params()
            .map(|p| {
                let v = value[p.name]
                    .as_f64()
                    .expect("every registered parameter is a serialized number");
                (p.name, v)
            })
            .collect()
    }

    /// Sets one parameter (not checked against the policy's ranges until
    /// [`Policy::validate`]).
    pub fn set(&mut self, name: &str, value: f64) -> Result<(), ParamError> {
        let spec = self.spec();
        let param = spec.param(name).ok_or_else(|| spec.unknown_param(name))?;
        let out_of_range = |expected| ParamError::OutOfRange {
            name: param.name.to_owned(),
            value,
            expected,
        };
        let mut fields = self.to_value();
        let slot = &mut fields[param.name];
        *slot = if slot.is_u64() {
            if !(value.is_finite()
                && value >= 0.0
                && value.fract() == 0.0
                && value <= u32::MAX as f64)
            {
                return Err(out_of_range("a whole number >= 0"));
            }
            Value::from(value as u64)
        } else {
            if !value.is_finite() {
                return Err(out_of_range("a finite number >= 0"));
            }
            Value::from(value)
        };
        *self = (spec.from_value)(fields).map_err(|_| out_of_range("a number of its type"))?;
        Ok(())
    }

    /// Checks every parameter: finite and `>= 0`, and the policy's own
    /// ranges.
    pub fn validate(&self) -> Result<(), ParamError> {
        for (name, value) in self.params() {
            if !(value.is_finite() && value >= 0.0) {
                return Err(ParamError::OutOfRange {
                    name: name.to_owned(),
                    value,
                    expected: "a finite number >= 0",
                });
            }
        }
        match self {
            Policy::SlaDynamic(p) => p.validate(),
            _ => Ok(()),
        }
    }

    fn to_value(&self) -> Value {
        serde_json::to_value(self).expect("a policy serializes to JSON")
    }
}

/// A config file's `[policy]` section: `name` (default `isl_or_load`) and
/// any of that policy's parameters, checked like [`Policy::with_params`].
impl<'de> Deserialize<'de> for Policy {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let mut fields = serde_json::Map::<String, Value>::deserialize(d)?;
        let name = match fields.remove("name") {
            None => Policy::default().name().to_owned(),
            Some(Value::String(name)) => name,
            Some(other) => {
                return Err(D::Error::custom(format!(
                    "name = {other}: expected a policy name"
                )))
            }
        };
        let mut params = Vec::with_capacity(fields.len());
        for (key, value) in &fields {
            let number = value
                .as_f64()
                .ok_or_else(|| D::Error::custom(format!("{key} = {value}: expected a number")))?;
            params.push((key.as_str(), number));
        }
        Policy::with_params(&name, params).map_err(D::Error::custom)
    }
}

impl ConditionalDisaggPolicy for Policy {
    fn decide(&self, input: &PolicyInput<'_>) -> Verdict {
        match self {
            Policy::AlwaysDisagg(p) => p.decide(input),
            Policy::NeverDisagg(p) => p.decide(input),
            Policy::Isl(p) => p.decide(input),
            Policy::Load(p) => p.decide(input),
            Policy::IslOrLoad(p) => p.decide(input),
            Policy::SlaDynamic(p) => p.decide(input),
        }
    }
}

macro_rules! from_policy {
    ($($variant:ident($ty:ty)),*) => {$(
        impl From<$ty> for Policy {
            fn from(p: $ty) -> Self {
                Policy::$variant(p)
            }
        }
    )*};
}

from_policy!(
    AlwaysDisagg(AlwaysDisagg),
    NeverDisagg(NeverDisagg),
    Isl(IslBased),
    Load(LoadBased),
    IslOrLoad(IslOrLoad),
    SlaDynamic(SlaDynamic)
);

#[cfg(test)]
mod tests {
    use super::*;

    /// The registry lists exactly the fields each policy serializes, so
    /// nothing a policy has escapes the flags, files and records.
    #[test]
    fn the_registry_names_every_field_of_every_policy() {
        for spec in &POLICIES {
            let policy = spec.default_policy();
            assert_eq!(policy.name(), spec.name);
            let mut fields: Vec<String> = match policy.to_value() {
                Value::Object(map) => map.keys().cloned().collect(),
                Value::Null => Vec::new(),
                other => panic!("{}: {other}", spec.name),
            };
            fields.sort();
            let mut listed: Vec<String> = spec.params().map(|p| p.name.to_owned()).collect();
            listed.sort();
            assert_eq!(fields, listed, "{}", spec.name);
            assert_eq!(policy.params().len(), spec.params().count());
            policy.validate().unwrap();
        }
    }

    /// `sim tune` sets each value of a parameter's grid over the defaults:
    /// every one is a valid setting.
    #[test]
    fn every_tuning_value_is_a_valid_setting() {
        let mut tuned = 0;
        for spec in &POLICIES {
            for param in spec.params() {
                for &value in param.tune {
                    let mut policy = spec.default_policy();
                    policy.set(param.name, value).unwrap();
                    policy.validate().unwrap();
                    assert!(policy.params().contains(&(param.name, value)));
                    tuned += 1;
                }
            }
        }
        assert!(tuned > 0);
    }

    /// Dynamo's names pick the same policies, with no deprecation note.
    #[test]
    fn dynamo_names() {
        for (dynamo, ours) in [
            ("isl_bounding", "isl"),
            ("prefill_load", "load"),
            ("isl_or_load", "isl_or_load"),
        ] {
            let found = PolicySpec::find(dynamo).unwrap();
            assert_eq!((found.spec.name, found.deprecated), (ours, false));
        }
    }

    #[test]
    fn names_and_earlier_spellings() {
        for (given, name, deprecated) in [
            ("isl_or_load", "isl_or_load", false),
            ("isl-or-load", "isl_or_load", true),
            ("ISL-or-load", "isl_or_load", true),
            ("sla", "sla_dynamic", true),
            ("sla_dynamic", "sla_dynamic", false),
            ("aggregated", "never_disagg", true),
            ("always-disagg", "always_disagg", true),
        ] {
            let found = PolicySpec::find(given).unwrap();
            assert_eq!(
                (found.spec.name, found.deprecated),
                (name, deprecated),
                "{given}"
            );
        }
        let e = PolicySpec::find("fastest").unwrap_err().to_string();
        assert!(
            e.contains("always_disagg, never_disagg, isl, load, isl_or_load, sla_dynamic"),
            "{e}"
        );
    }

    #[test]
    fn a_config_section_names_the_policy_and_its_parameters() {
        let p: Policy = serde_json::from_str(r#"{"name": "isl", "eff_isl_tokens": 512}"#).unwrap();
        assert_eq!(
            p,
            Policy::Isl(IslBased {
                eff_isl_tokens: 512,
                ..IslBased::default()
            })
        );
        let p: Policy = serde_json::from_str("{}").unwrap();
        assert_eq!(p, Policy::default());
        let e =
            serde_json::from_str::<Policy>(r#"{"name": "isl", "prefill_busy": 1}"#).unwrap_err();
        assert!(
            e.to_string()
                .contains("policy isl has no parameter \"prefill_busy\""),
            "{e}"
        );
        let e = serde_json::from_str::<Policy>(r#"{"eff_isl_ratio": "high"}"#).unwrap_err();
        assert!(
            e.to_string()
                .contains("eff_isl_ratio = \"high\": expected a number"),
            "{e}"
        );
    }

    #[test]
    fn parameters_round_trip_and_are_checked() {
        let p = Policy::with_params(
            "isl_or_load",
            [("eff_isl_tokens", 512.0), ("decode_busy", 0.5)],
        )
        .unwrap();
        assert_eq!(
            p,
            Policy::IslOrLoad(IslOrLoad {
                isl: IslBased {
                    eff_isl_tokens: 512,
                    ..IslBased::default()
                },
                load: LoadBased {
                    decode_busy: 0.5,
                    ..LoadBased::default()
                },
            })
        );
        let recorded: Vec<(&str, f64)> = p.params();
        assert_eq!(Policy::with_params(p.name(), recorded).unwrap(), p);

        let e = Policy::with_params("isl", [("eff_isl_tokens", 1.5)]).unwrap_err();
        assert!(e.to_string().contains("a whole number"), "{e}");
        let e = Policy::with_params("isl", [("eff_isl_ratio", -0.1)]).unwrap_err();
        assert!(e.to_string().starts_with("eff_isl_ratio = -0.1"), "{e}");
        let e = Policy::with_params("isl", [("eff_isl_ratio", f64::NAN)]).unwrap_err();
        assert!(e.to_string().starts_with("eff_isl_ratio"), "{e}");
        let e = Policy::with_params("load", [("eff_isl_tokens", 1.0)]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "policy load has no parameter \"eff_isl_tokens\" (it has: prefill_busy, decode_busy)"
        );
        let e = Policy::with_params("never_disagg", [("x", 1.0)]).unwrap_err();
        assert!(e.to_string().ends_with("(it has: none)"), "{e}");
        let e = Policy::with_params("sla_dynamic", [("itl_target_ms", 0.0)]).unwrap_err();
        assert!(e.to_string().contains("> 0"), "{e}");
    }
}
