//! Executor-type derivation and grouping (design section III-B).
//!
//! Owns the rule "tags first, then rule kind, then the implicit default" and
//! the interning of executor sets into small group ids, so that grouping ten
//! million targets does not allocate a set per target.

use crate::types::{ExecutorConfig, ExecutorSet, Target};
use std::collections::HashMap;

/// Executor types a target needs.
///
/// Tags that map to a type (`requires-gpu`, `requires-mac`, or config
/// entries) win; only when none matches is the rule kind consulted. The
/// config's `implicit` types are always added (see [`ExecutorConfig`]).
pub fn executor_types(target: &Target, cfg: &ExecutorConfig) -> ExecutorSet {
    let mut set = cfg.implicit.clone();
    let mut tagged = false;
    for tag in &target.tags {
        if let Some(t) = cfg.tag_types.get(tag.as_str()) {
            set.insert(t.clone());
            tagged = true;
        }
    }
    if !tagged && let Some(types) = target.rule_kind.as_deref().and_then(|k| cfg.rule_kind_types.get(k)) {
        set.extend(types.iter().cloned());
    }
    set
}

/// Interns executor sets into dense group ids, with an allocation-free fast
/// path for the (overwhelmingly common) untagged target.
#[derive(Debug, Clone)]
pub struct Grouper {
    cfg: ExecutorConfig,
    sets: Vec<ExecutorSet>,
    ids: HashMap<ExecutorSet, usize>,
}

impl Grouper {
    pub fn new(cfg: &ExecutorConfig) -> Self {
        let mut g = Grouper { cfg: cfg.clone(), sets: Vec::new(), ids: HashMap::new() };
        // Group 0 is always the implicit set.
        g.intern(cfg.implicit.clone());
        g
    }

    fn intern(&mut self, set: ExecutorSet) -> usize {
        if let Some(&id) = self.ids.get(&set) {
            return id;
        }
        let id = self.sets.len();
        self.sets.push(set.clone());
        self.ids.insert(set, id);
        id
    }

    /// Group id of a target.
    pub fn group_of(&mut self, target: &Target) -> usize {
        let cfg = &self.cfg;
        let tag_hit = target.tags.iter().any(|t| cfg.tag_types.contains_key(t.as_str()));
        let kind_hit = !tag_hit && target.rule_kind.as_deref().is_some_and(|k| cfg.rule_kind_types.contains_key(k));
        if !tag_hit && !kind_hit {
            return 0;
        }
        let set = executor_types(target, &self.cfg);
        self.intern(set)
    }

    /// The executor set of a group id.
    pub fn set(&self, id: usize) -> &ExecutorSet {
        &self.sets[id]
    }

    pub fn group_count(&self) -> usize {
        self.sets.len()
    }
}

/// Split targets into executor-set groups, in first-seen group order.
/// Order inside a group is the input order (sorting is the planner's job).
pub fn group_targets(targets: Vec<Target>, cfg: &ExecutorConfig) -> Vec<(ExecutorSet, Vec<Target>)> {
    let mut grouper = Grouper::new(cfg);
    let mut groups: Vec<Vec<Target>> = vec![Vec::new()];
    for t in targets {
        let id = grouper.group_of(&t);
        if id >= groups.len() {
            groups.resize_with(id + 1, Vec::new);
        }
        groups[id].push(t);
    }
    groups.into_iter().enumerate().filter(|(_, g)| !g.is_empty()).map(|(id, g)| (grouper.set(id).clone(), g)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(label: &str, kind: Option<&str>, tags: &[&str]) -> Target {
        Target {
            label: label.into(),
            rule_kind: kind.map(str::to_string),
            tags: tags.iter().map(|s| s.to_string()).collect(),
        }
    }

    fn set(items: &[&str]) -> ExecutorSet {
        items.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn tags_then_rule_kind_then_default() {
        let cfg = ExecutorConfig::default();
        assert_eq!(executor_types(&t("//a:b", None, &[]), &cfg), set(&["x86"]));
        assert_eq!(executor_types(&t("//a:b", None, &["requires-gpu"]), &cfg), set(&["gpu", "x86"]));
        assert_eq!(executor_types(&t("//a:b", Some("ios_ui_test"), &[]), &cfg), set(&["mac", "x86"]));
        // A matching tag suppresses the rule-kind lookup.
        assert_eq!(executor_types(&t("//a:b", Some("ios_ui_test"), &["requires-gpu"]), &cfg), set(&["gpu", "x86"]));
        // Unrelated tags and kinds fall through to the default.
        assert_eq!(executor_types(&t("//a:b", Some("cc_test"), &["manual"]), &cfg), set(&["x86"]));
    }

    #[test]
    fn config_mappings_and_exact_sets() {
        let mut cfg = ExecutorConfig::default();
        cfg.tag_types.insert("requires-tpu".into(), "tpu".into());
        cfg.implicit.clear();
        assert_eq!(executor_types(&t("//a:b", None, &["requires-tpu", "requires-gpu"]), &cfg), set(&["gpu", "tpu"]));
        assert_eq!(executor_types(&t("//a:b", None, &[]), &cfg), set(&[]));
    }

    #[test]
    fn groups_never_mix_sets() {
        let cfg = ExecutorConfig::default();
        let targets = vec![
            t("//a:1", None, &[]),
            t("//a:2", None, &["requires-gpu"]),
            t("//a:3", Some("ios_ui_test"), &[]),
            t("//a:4", None, &[]),
            t("//a:5", None, &["requires-gpu", "flaky"]),
        ];
        let groups = group_targets(targets, &cfg);
        assert_eq!(groups.len(), 3);
        let find = |s: &ExecutorSet| groups.iter().find(|(k, _)| k == s).unwrap();
        let x86: Vec<_> = find(&set(&["x86"])).1.iter().map(|t| t.label.as_str()).collect();
        assert_eq!(x86, vec!["//a:1", "//a:4"]);
        let gpu: Vec<_> = find(&set(&["gpu", "x86"])).1.iter().map(|t| t.label.as_str()).collect();
        assert_eq!(gpu, vec!["//a:2", "//a:5"]);
        assert_eq!(find(&set(&["mac", "x86"])).1.len(), 1);
    }
}
