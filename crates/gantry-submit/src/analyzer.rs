//! The conflict analyzer's I/O half: a commit's build graph from `bazel query` output
//! (`deps(//...)`, XML, explicit dependencies) plus git's blob ids as the source-file
//! digests, turned into gantry-queue's [`TargetGraph`]. Hashing, affected sets and
//! independence are gantry-queue's pure [`gantry_queue::ConflictAnalyzer`].
//!
//! A rule's attribute digest covers every attribute line of the XML except its location
//! (line numbers move when an unrelated rule in the same BUILD file is edited); a source
//! file's digest is its git blob id; a generated file depends on its generating rule.

use std::collections::HashMap;

use gantry_core::DigestFunction;
use gantry_queue::{ChangeAnalysis, TargetGraph, TargetNode};

/// The attribute digest given to source files; [`is_rule`] tells them apart.
const SOURCE_FILE: &str = "source-file";

/// Whether a node of a graph from [`parse_query_xml`] is a rule (a buildable target).
pub fn is_rule(node: &TargetNode) -> bool {
    node.attrs_digest != SOURCE_FILE && !node.attrs_digest.starts_with("generated-file")
}

fn attr<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    let key = format!(" {name}=\"");
    let start = line.find(&key)? + key.len();
    let end = line[start..].find('"')?;
    Some(&line[start..start + end])
}

/// `//pkg:name` -> `pkg/name`, for labels of the main repository.
fn label_path(label: &str) -> Option<String> {
    let rest = label.strip_prefix("//")?;
    let (pkg, name) = rest.split_once(':')?;
    Some(if pkg.is_empty() { name.to_string() } else { format!("{pkg}/{name}") })
}

/// Parses `bazel query --output=xml` into a graph; `files` maps paths to content digests.
/// Targets of other repositories (`@...`) stay out of the graph: the analyzer treats
/// them as opaque labels.
pub fn parse_query_xml(xml: &str, files: &HashMap<String, String>) -> Result<TargetGraph, String> {
    let mut graph = TargetGraph::default();
    let mut current: Option<(String, TargetNode, gantry_core::Hasher)> = None;
    for raw in xml.lines() {
        let line = raw.trim();
        if let Some((name, mut node, hasher)) = current.take() {
            if line == "</rule>" {
                node.attrs_digest = hasher.finish().to_string();
                graph.targets.insert(name, node);
                continue;
            }
            let mut hasher = hasher;
            if line.starts_with("<rule-input ") {
                if let Some(dep) = attr(line, "name") {
                    node.deps.push(dep.to_string());
                }
            } else if attr(line, "name") != Some("generator_location") {
                hasher.update(line.as_bytes());
                hasher.update(b"\n");
            }
            current = Some((name, node, hasher));
            continue;
        }
        let Some(name) = attr(line, "name").filter(|n| n.starts_with("//")) else { continue };
        if line.starts_with("<rule ") {
            let mut hasher = DigestFunction::Sha256.hasher();
            hasher.update(attr(line, "class").unwrap_or_default().as_bytes());
            hasher.update(b"\n");
            let node = TargetNode::default();
            if line.ends_with("/>") {
                graph
                    .targets
                    .insert(name.to_string(), TargetNode { attrs_digest: hasher.finish().to_string(), ..node });
            } else {
                current = Some((name.to_string(), node, hasher));
            }
        } else if line.starts_with("<source-file ") {
            let digest = label_path(name).and_then(|p| files.get(&p).cloned()).unwrap_or_else(|| "not-a-file".into());
            graph.targets.insert(
                name.to_string(),
                TargetNode { attrs_digest: SOURCE_FILE.into(), srcs: vec![digest], deps: vec![] },
            );
        } else if line.starts_with("<generated-file ") {
            let rule = attr(line, "generating-rule").unwrap_or_default().to_string();
            graph.targets.insert(
                name.to_string(),
                TargetNode { attrs_digest: "generated-file".into(), srcs: vec![], deps: vec![rule] },
            );
        } else if line.starts_with("<package-group ") || line.starts_with("<environment-group ") {
            // package groups, environment groups: whatever they say is their identity.
            let text = line.split(" location=\"").next().unwrap_or(line);
            let digest = DigestFunction::Sha256.digest_of(text.as_bytes()).to_string();
            graph.targets.insert(name.to_string(), TargetNode { attrs_digest: digest, srcs: vec![], deps: vec![] });
        }
    }
    if current.is_some() {
        return Err("bazel query output ended inside a <rule>".into());
    }
    Ok(graph)
}

/// `analysis` of a change that touched `paths`. A change to the workspace, rc files or
/// Starlark can alter how targets are built without showing in the query, so it alters
/// the graph in ways no reach describes: it is dependent on every other change.
pub fn with_changed_paths(mut analysis: ChangeAnalysis, paths: &[String]) -> ChangeAnalysis {
    if touches_build_definitions(paths) {
        analysis.alters_graph = true;
        analysis.graph_reach = None;
    }
    analysis
}

/// Files whose change can alter how targets are built without showing in the query:
/// the workspace, rc files and Starlark. A change touching one counts as altering the graph.
pub fn touches_build_definitions(paths: &[String]) -> bool {
    paths.iter().any(|p| {
        let file = p.rsplit('/').next().unwrap_or(p);
        p.ends_with(".bzl")
            || matches!(file, "WORKSPACE" | "WORKSPACE.bazel" | "MODULE.bazel" | ".bazelrc" | ".bazelversion")
    })
}

/// Flags of `extra_flags` that `bazel query` accepts (repository options); build-only
/// flags would make it refuse to run.
pub fn query_flags(extra_flags: &[String]) -> Vec<String> {
    const QUERY_OPTIONS: [&str; 4] =
        ["--override_repository", "--experimental_repository_disable_download", "--repository_cache", "--distdir"];
    extra_flags.iter().filter(|f| QUERY_OPTIONS.iter().any(|o| f.starts_with(o))).cloned().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const XML: &str = r#"<?xml version="1.1" encoding="UTF-8" standalone="no"?>
<query version="2">
    <rule class="sh_test" location="/ws/a/BUILD:1:8" name="//a:a_test">
        <string name="name" value="a_test"/>
        <list name="srcs">
            <label value="//a:test.sh"/>
        </list>
        <list name="data">
            <label value="//a:value.txt"/>
        </list>
        <string name="generator_location" value="a/BUILD:1:8"/>
        <rule-input name="//a:test.sh"/>
        <rule-input name="//a:value.txt"/>
        <rule-input name="@ext//:tool"/>
    </rule>
    <source-file location="/ws/a/BUILD:1:8" name="//a:test.sh">
        <visibility-label name="//visibility:private"/>
    </source-file>
    <source-file location="/ws/a/BUILD:1:8" name="//a:value.txt"/>
    <generated-file generating-rule="//a:gen" location="/ws/a/BUILD:9:8" name="//a:out.txt"/>
    <rule class="genrule" location="/ws/a/BUILD:9:8" name="//a:gen"/>
</query>
"#;

    fn files(v: &str) -> HashMap<String, String> {
        [("a/test.sh".to_string(), "t1".to_string()), ("a/value.txt".to_string(), v.to_string())].into()
    }

    #[test]
    fn parses_rules_sources_and_generated_files() {
        let g = parse_query_xml(XML, &files("v1")).unwrap();
        assert_eq!(g.targets.len(), 5);
        let t = &g.targets["//a:a_test"];
        assert_eq!(t.deps, ["//a:test.sh", "//a:value.txt", "@ext//:tool"]);
        assert!(is_rule(t) && is_rule(&g.targets["//a:gen"]));
        assert_eq!(g.targets["//a:value.txt"].srcs, ["v1"]);
        assert!(!is_rule(&g.targets["//a:value.txt"]) && !is_rule(&g.targets["//a:out.txt"]));
        assert_eq!(g.targets["//a:out.txt"].deps, ["//a:gen"]);
    }

    #[test]
    fn content_changes_propagate_and_locations_do_not_count() {
        let base = parse_query_xml(XML, &files("v1")).unwrap();
        let moved = parse_query_xml(&XML.replace("BUILD:1:8", "BUILD:3:8"), &files("v1")).unwrap();
        let a = gantry_queue::conflict::analyze(&base, &moved).unwrap();
        assert!(a.affected.is_empty() && !a.alters_graph, "{a:?}");
        let edited = parse_query_xml(XML, &files("v2")).unwrap();
        let a = gantry_queue::conflict::analyze(&base, &edited).unwrap();
        assert_eq!(a.affected.iter().map(String::as_str).collect::<Vec<_>>(), ["//a:a_test", "//a:value.txt"]);
        assert!(!a.alters_graph);
        let attrs = parse_query_xml(&XML.replace("value=\"a_test\"", "value=\"a_test2\""), &files("v1")).unwrap();
        assert!(gantry_queue::conflict::analyze(&base, &attrs).unwrap().affected.contains("//a:a_test"));
        assert!(parse_query_xml("<rule class=\"x\" name=\"//a:b\">\n", &files("v1")).is_err());
    }

    #[test]
    fn build_definition_files_and_query_flags() {
        assert!(touches_build_definitions(&["tools/defs.bzl".into()]));
        assert!(touches_build_definitions(&["WORKSPACE".into()]));
        assert!(!touches_build_definitions(&["a/BUILD".into(), "a/x.txt".into()]));
        // A BUILD edit keeps the reach the graphs gave; Starlark takes it away.
        let reach = ChangeAnalysis {
            affected: ["//a:bin".to_string()].into(),
            alters_graph: true,
            graph_reach: Some(["//a:bin".to_string(), "//lib:x".to_string()].into()),
        };
        assert_eq!(with_changed_paths(reach.clone(), &["a/BUILD".into()]), reach);
        let starlark = with_changed_paths(reach, &["a/BUILD".into(), "tools/defs.bzl".into()]);
        assert!(starlark.alters_graph && starlark.graph_reach.is_none());
        let plain = ChangeAnalysis { affected: ["//a:lib".to_string()].into(), ..ChangeAnalysis::default() };
        let plain = with_changed_paths(plain, &["WORKSPACE".into()]);
        assert!(plain.alters_graph && plain.graph_reach.is_none());
        assert!(!plain
            .independent_of(&ChangeAnalysis { affected: ["//b:lib".to_string()].into(), ..ChangeAnalysis::default() }));
        let f = query_flags(&["--nosandbox_debug".into(), "--override_repository=r=/p".into()]);
        assert_eq!(f, ["--override_repository=r=/p"]);
    }
}
