//! Where a build runs: a workspace path as given, or a git worktree of the repository
//! checked out at the revision. Each runner keeps one worktree per repository and moves
//! it between revisions, so the output base stays warm for the same repository.

use std::path::{Path, PathBuf};
use std::process::Command;

use gantry_batch::BuildContext;

fn is_workspace(dir: &Path) -> bool {
    ["WORKSPACE", "WORKSPACE.bazel", "MODULE.bazel"].iter().any(|f| dir.join(f).is_file())
}

/// Runs git in `dir`; stdout trimmed, or an error with git's stderr.
pub fn git(dir: &Path, args: &[&str]) -> Result<String, String> {
    let out = Command::new("git").arg("-C").arg(dir).args(args).output().map_err(|e| format!("running git: {e}"))?;
    if !out.status.success() {
        return Err(format!("git {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The directory the build runs in; an error names what is wrong with the context.
/// Blocking (runs git): call from a blocking task.
pub fn prepare(ctx: &BuildContext, runner_dir: &Path) -> Result<PathBuf, String> {
    if let Some(ws) = &ctx.workspace {
        let dir = PathBuf::from(ws);
        if !is_workspace(&dir) {
            return Err(format!(
                "context.execution.workspace {ws}: no WORKSPACE, WORKSPACE.bazel or MODULE.bazel there"
            ));
        }
        return Ok(dir);
    }
    let (Some(repo), Some(rev)) = (&ctx.git_repo, &ctx.revision) else {
        return Err("context.execution: neither a workspace nor a git repository and revision".into());
    };
    let tree = checkout(Path::new(repo), rev, runner_dir).map_err(|e| format!("context.execution.git: {e}"))?;
    if !is_workspace(&tree) {
        return Err(format!(
            "context.execution.git: {rev} has no WORKSPACE, WORKSPACE.bazel or MODULE.bazel at its root"
        ));
    }
    Ok(tree)
}

/// This runner's worktree of `repo`, moved to `rev` and cleaned of anything untracked.
/// Shared by the batching service and the submit queue. Blocking (runs git).
pub fn checkout(repo: &Path, rev: &str, runner_dir: &Path) -> Result<PathBuf, String> {
    let commit = git(repo, &["rev-parse", "--verify", &format!("{rev}^{{commit}}")])
        .map_err(|e| format!("revision {rev} in {}: {e}", repo.display()))?;
    let name = format!("{:016x}", gantry_batch::features::fnv1a(repo.to_string_lossy().as_bytes()));
    let tree = runner_dir.join("src").join(name);
    if tree.join(".git").exists() {
        git(&tree, &["checkout", "--quiet", "--detach", "--force", &commit])?;
        // Leftovers of the previous revision must not leak into this build.
        git(&tree, &["clean", "--quiet", "-ffdx"])?;
    } else {
        std::fs::create_dir_all(tree.parent().expect("has parent")).map_err(|e| format!("{}: {e}", tree.display()))?;
        let _ = std::fs::remove_dir_all(&tree);
        let _ = git(repo, &["worktree", "prune"]);
        git(repo, &["worktree", "add", "--quiet", "--detach", "--force", &tree.to_string_lossy(), &commit])?;
    }
    Ok(tree)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(workspace: Option<&str>, git: Option<(&str, &str)>) -> BuildContext {
        BuildContext {
            workspace: workspace.map(str::to_string),
            git_repo: git.map(|g| g.0.to_string()),
            revision: git.map(|g| g.1.to_string()),
            command: gantry_batch::Command::Build,
            flags: vec![],
            priority: gantry_batch::Priority::Medium,
            user: String::new(),
            product_area: String::new(),
            tool_tag: String::new(),
        }
    }

    #[test]
    fn workspace_must_be_a_bazel_workspace() {
        let d = tempfile::tempdir().unwrap();
        let err = prepare(&ctx(Some(d.path().to_str().unwrap()), None), d.path()).unwrap_err();
        assert!(err.contains("no WORKSPACE"), "{err}");
        std::fs::write(d.path().join("WORKSPACE"), "").unwrap();
        assert_eq!(prepare(&ctx(Some(d.path().to_str().unwrap()), None), d.path()).unwrap(), d.path());
    }

    #[test]
    fn git_revisions_get_a_clean_worktree_per_runner() {
        let d = tempfile::tempdir().unwrap();
        let repo = d.path().join("repo");
        std::fs::create_dir_all(&repo).unwrap();
        let run = |args: &[&str]| git(&repo, args).unwrap();
        run(&["init", "--quiet"]);
        run(&["config", "user.email", "t@example.com"]);
        run(&["config", "user.name", "t"]);
        std::fs::write(repo.join("WORKSPACE"), "").unwrap();
        std::fs::write(repo.join("a.txt"), "one").unwrap();
        run(&["add", "."]);
        run(&["commit", "--quiet", "-m", "one"]);
        let first = run(&["rev-parse", "HEAD"]);
        std::fs::write(repo.join("a.txt"), "two").unwrap();
        run(&["commit", "--quiet", "-am", "two"]);
        let runner = d.path().join("runner");
        let r = repo.to_str().unwrap();
        let tree = prepare(&ctx(None, Some((r, "HEAD"))), &runner).unwrap();
        assert_eq!(std::fs::read_to_string(tree.join("a.txt")).unwrap(), "two");
        std::fs::write(tree.join("stray"), "x").unwrap();
        let again = prepare(&ctx(None, Some((r, &first))), &runner).unwrap();
        assert_eq!(again, tree);
        assert_eq!(std::fs::read_to_string(tree.join("a.txt")).unwrap(), "one");
        assert!(!tree.join("stray").exists());
        let err = prepare(&ctx(None, Some((r, "no-such-rev"))), &runner).unwrap_err();
        assert!(err.contains("no-such-rev"), "{err}");
    }
}
