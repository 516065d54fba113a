//! Either rule: bypass when the ISL rule or the load rule says so.

use protocol::Path;
use serde::{Deserialize, Serialize};

use super::{ConditionalDisaggPolicy, IslBased, LoadBased, PolicyInput, Verdict};

/// Bypass iff the ISL rule or the load rule says bypass. A bypass carries
/// the rule that allowed it; a remote verdict carries the ISL rule's label
/// and both rules' numbers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct IslOrLoad {
    /// The ISL rule.
    #[serde(flatten)]
    pub isl: IslBased,
    /// The load rule.
    #[serde(flatten)]
    pub load: LoadBased,
}

impl ConditionalDisaggPolicy for IslOrLoad {
    fn decide(&self, input: &PolicyInput<'_>) -> Verdict {
        let isl = self.isl.check(input);
        if isl.bypass() {
            let (path, rule, reason) = self.isl.clause(&isl, input);
            return Verdict::new(path, rule, reason);
        }
        let load = self.load.check(input);
        let (load_path, load_rule, load_reason) = self.load.clause(&load, input);
        if load_path == Path::Bypass {
            return Verdict::new(load_path, load_rule, load_reason);
        }
        let (_, rule, isl_reason) = self.isl.clause(&isl, input);
        Verdict::new(
            Path::Remote,
            rule,
            format!("{isl_reason}; and {load_reason}"),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::policy::rules;
    use crate::core::policy::tests::{load, Fixture};

    #[test]
    fn isl_or_load_bypasses_when_either_does() {
        let f = Fixture::new();
        let policy = IslOrLoad::default();
        let idle = load(0, 0);
        let busy_p = load(20_000, 0);
        // short append, prefill idle: ISL bypass
        let v = policy.decide(&f.input(10_000, 9_000, idle, idle));
        assert_eq!((v.path, v.rule), (Path::Bypass, rules::ISL_SHORT_APPEND));
        // long cold prompt, prefill busy, decode free: load bypass
        let v = policy.decide(&f.input(10_000, 0, idle, busy_p));
        assert_eq!((v.path, v.rule), (Path::Bypass, rules::LOAD_PREFILL_BUSY));
        // long cold prompt, prefill busy, decode busy: remote
        let v = policy.decide(&f.input(10_000, 0, load(0, 9_000), busy_p));
        assert_eq!((v.path, v.rule), (Path::Remote, rules::ISL_LONG_PREFILL));
        assert!(v.reason.contains("; and p0 is busy"), "{}", v.reason);
        // long cold prompt, prefill idle: remote
        let v = policy.decide(&f.input(10_000, 0, idle, idle));
        assert_eq!((v.path, v.rule), (Path::Remote, rules::ISL_LONG_PREFILL));
        assert_eq!(crate::core::Policy::from(policy).params().len(), 5);
    }
}
