//! Generator of the batching end-to-end test's Bazel workspace: packages of very
//! different analysis weight (macros that expand to many genrules next to packages of
//! single genrules) and a few tests, some tagged `requires-gpu`.

use std::fmt::Write as _;
use std::path::Path;

/// The shape of the generated workspace.
pub struct Shape {
    /// Packages holding macro targets, each expanding to `fan_out` genrules.
    pub heavy_packages: usize,
    pub heavy_per_package: usize,
    pub fan_out: usize,
    /// Packages of single genrules.
    pub light_packages: usize,
    pub light_per_package: usize,
    /// sh_tests; the first `gpu_tests` of them are tagged requires-gpu.
    pub tests: usize,
    pub gpu_tests: usize,
}

/// One target of the generated workspace, as a `gantry batch --targets` line needs it.
pub struct GenTarget {
    pub label: String,
    pub kind: &'static str,
    pub gpu: bool,
    /// Genrules the target expands to (its analysis weight).
    pub genrules: usize,
}

impl GenTarget {
    pub fn line(&self) -> String {
        if self.gpu {
            format!("{} {} requires-gpu", self.label, self.kind)
        } else {
            format!("{} {}", self.label, self.kind)
        }
    }
}

/// Writes the workspace under `root` and returns its targets.
pub fn generate(root: &Path, shape: &Shape) -> Vec<GenTarget> {
    let mut targets = Vec::new();
    std::fs::create_dir_all(root).unwrap();
    std::fs::write(root.join("WORKSPACE"), "workspace(name = \"batch_e2e\")\n").unwrap();
    for p in 0..shape.heavy_packages {
        let dir = root.join(format!("heavy{p}"));
        std::fs::create_dir_all(&dir).unwrap();
        // Every genrule of a fan-out is its own action: analysis heap grows with them.
        std::fs::write(
            dir.join("defs.bzl"),
            "def fan(name, n):\n    outs = []\n    for i in range(n):\n        native.genrule(name = \"%s_%d\" % (name, i), outs = [\"%s_%d.txt\" % (name, i)], cmd = \"echo %d > $@\" % i)\n        outs.append(\":%s_%d\" % (name, i))\n    native.filegroup(name = name, srcs = outs)\n",
        )
        .unwrap();
        let mut build = String::from("load(\":defs.bzl\", \"fan\")\n\n");
        for t in 0..shape.heavy_per_package {
            writeln!(build, "fan(name = \"fan{t}\", n = {})", shape.fan_out).unwrap();
            targets.push(GenTarget {
                label: format!("//heavy{p}:fan{t}"),
                kind: "filegroup",
                gpu: false,
                genrules: shape.fan_out,
            });
        }
        std::fs::write(dir.join("BUILD"), build).unwrap();
    }
    for p in 0..shape.light_packages {
        let dir = root.join(format!("light{p}"));
        std::fs::create_dir_all(&dir).unwrap();
        let mut build = String::new();
        for t in 0..shape.light_per_package {
            writeln!(build, "genrule(name = \"g{t}\", outs = [\"g{t}.txt\"], cmd = \"echo light {p} {t} > $@\")")
                .unwrap();
            targets.push(GenTarget { label: format!("//light{p}:g{t}"), kind: "genrule", gpu: false, genrules: 1 });
        }
        std::fs::write(dir.join("BUILD"), build).unwrap();
    }
    let dir = root.join("tests");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("pass.sh"), "#!/bin/sh\necho ok\n").unwrap();
    let mut build = String::new();
    for t in 0..shape.tests {
        let gpu = t < shape.gpu_tests;
        let tags = if gpu { ", tags = [\"requires-gpu\"]" } else { "" };
        writeln!(build, "sh_test(name = \"t{t}\", srcs = [\"pass.sh\"]{tags})").unwrap();
        targets.push(GenTarget { label: format!("//tests:t{t}"), kind: "sh_test", gpu, genrules: 0 });
    }
    std::fs::write(dir.join("BUILD"), build).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.join("pass.sh"), std::fs::Permissions::from_mode(0o755)).unwrap();
    targets
}
