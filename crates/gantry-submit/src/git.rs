//! The queue's git operations, all on object ids (no working tree): resolving a
//! submitted ref, making the speculative commit "this change on top of that commit", and
//! moving the mainline with a compare-and-swap.
//!
//! Speculative commits are deterministic: the tree is a three-way merge of the change's
//! patch (its merge base to its head) onto the parent, and author, committer, dates and
//! message are taken from the change, so the same change on the same parent is always the
//! same commit id. A build assuming A then B therefore tests the very commit that B lands
//! as once A has landed: landing is a fast-forward to the tested commit.
//!
//! Blocking: call from `spawn_blocking`.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Output};

pub use gantry_builds::workspace::git;
use thiserror::Error;

/// Why a git operation failed. The messages end up in front of people (a rejected change's
/// reason, the log, a refused submission), so each keeps what it takes to act on it: the
/// command, how git exited and what it said, or, for a conflict, the files.
#[derive(Debug, Error)]
pub enum GitError {
    /// git could not be started at all.
    #[error("running git {command}: {source}")]
    Spawn {
        command: String,
        #[source]
        source: std::io::Error,
    },
    /// git ran and exited unsuccessfully.
    #[error("git {command} ({status}): {stderr}")]
    Failed { command: String, status: ExitStatus, stderr: String },
    /// The submitted ref cannot be queued; the message is for whoever submitted it.
    #[error("{0}")]
    BadRef(String),
    /// The patch conflicts with the commit it was applied on.
    #[error("{patch} does not apply on {}: conflicts in {}", short(parent), files.join(", "))]
    Conflict { patch: String, parent: String, files: Vec<String> },
    /// git succeeded but its output is not what was asked for.
    #[error("reading {what}: {output:?}")]
    Unexpected { what: String, output: String },
    /// The blocking task running git panicked or was cancelled.
    #[error("git task: {0}")]
    Task(String),
}

impl GitError {
    fn failed(command: String, out: &Output) -> GitError {
        GitError::Failed {
            command,
            status: out.status,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        }
    }
}

/// What a change is: its head and where it left the mainline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Patch {
    pub merge_base: String,
    pub head: String,
    /// A line for messages ("c3 (feature-x)").
    pub name: String,
}

#[derive(Debug, Clone)]
pub struct Repo {
    pub path: PathBuf,
    pub mainline: String,
}

impl Repo {
    pub fn new(path: &Path, mainline: &str) -> Repo {
        Repo { path: path.to_path_buf(), mainline: mainline.to_string() }
    }

    /// `git args` in the repository: its trimmed output, or what went wrong with the command.
    fn git(&self, args: &[&str]) -> Result<String, GitError> {
        let (command, out) = self.run(args)?;
        if !out.status.success() {
            return Err(GitError::failed(command, &out));
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    }

    /// Runs `git args` in the repository: the command line (for messages) and its output.
    fn run(&self, args: &[&str]) -> Result<(String, std::process::Output), GitError> {
        let command = args.join(" ");
        let out = Command::new("git")
            .arg("-C")
            .arg(&self.path)
            .args(args)
            .output()
            .map_err(|source| GitError::Spawn { command: command.clone(), source })?;
        Ok((command, out))
    }

    pub fn mainline_ref(&self) -> String {
        format!("refs/heads/{}", self.mainline)
    }

    /// The mainline's current commit.
    pub fn head(&self) -> Result<String, GitError> {
        self.git(&["rev-parse", "--verify", &format!("{}^{{commit}}", self.mainline_ref())])
    }

    /// Resolves a submitted ref to (its commit, its merge base with the mainline).
    pub fn resolve(&self, reference: &str) -> Result<(String, String), GitError> {
        if reference.is_empty() || reference.starts_with('-') {
            return Err(GitError::BadRef(format!("change_ref {reference:?} is not a branch or commit")));
        }
        let commit = self
            .git(&["rev-parse", "--verify", "--end-of-options", &format!("{reference}^{{commit}}")])
            .map_err(|_| {
                GitError::BadRef(format!(
                    "change_ref {reference:?} is not a branch or commit in {}",
                    self.path.display()
                ))
            })?;
        let base = self.git(&["merge-base", &commit, &self.mainline_ref()]).map_err(|_| {
            GitError::BadRef(format!("change_ref {reference:?} shares no history with {}", self.mainline))
        })?;
        if base == commit {
            return Err(GitError::BadRef(format!(
                "change_ref {reference:?} is already on {} (nothing to land)",
                self.mainline
            )));
        }
        Ok((commit, base))
    }

    /// Whether `ancestor` is `commit` or one of its ancestors.
    pub fn is_ancestor(&self, ancestor: &str, commit: &str) -> Result<bool, GitError> {
        let (command, out) = self.run(&["merge-base", "--is-ancestor", ancestor, commit])?;
        match out.status.code() {
            Some(0) => Ok(true),
            Some(1) => Ok(false),
            _ => Err(GitError::failed(command, &out)),
        }
    }

    pub fn tree(&self, commit: &str) -> Result<String, GitError> {
        self.git(&["rev-parse", &format!("{commit}^{{tree}}")])
    }

    pub fn parent(&self, commit: &str) -> Result<String, GitError> {
        self.git(&["rev-parse", &format!("{commit}^1")])
    }

    /// `patch` applied on `parent` as a new commit, or why it does not apply.
    pub fn apply(&self, patch: &Patch, parent: &str) -> Result<String, GitError> {
        let merge_base = format!("--merge-base={}", patch.merge_base);
        let args =
            ["merge-tree", "--write-tree", "--no-messages", "--name-only", merge_base.as_str(), parent, &patch.head];
        let out = Command::new("git")
            .arg("-C")
            .arg(&self.path)
            .args(args)
            .output()
            .map_err(|source| GitError::Spawn { command: args.join(" "), source })?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        let mut lines = stdout.lines();
        let tree = lines.next().unwrap_or_default().trim().to_string();
        match out.status.code() {
            Some(0) => {}
            Some(1) => {
                return Err(GitError::Conflict {
                    patch: patch.name.clone(),
                    parent: parent.to_string(),
                    files: lines.filter(|l| !l.is_empty()).map(str::to_string).collect(),
                });
            }
            _ => return Err(GitError::failed(args.join(" "), &out)),
        }
        self.commit_like(&patch.head, &tree, parent)
    }

    /// A commit with `tree` and `parent` whose author, committer and message are those of
    /// `like` (deterministic: same inputs, same id).
    pub fn commit_like(&self, like: &str, tree: &str, parent: &str) -> Result<String, GitError> {
        let meta = self.git(&["log", "-1", "--format=%an%x00%ae%x00%ad", "--date=raw", like])?;
        let f: Vec<&str> = meta.split('\0').collect();
        let [name, email, date] = f[..] else {
            return Err(GitError::Unexpected { what: format!("the author of {like}"), output: meta });
        };
        let message = self.git(&["log", "-1", "--format=%B", like])?;
        let args = ["commit-tree", tree, "-p", parent, "-F", "-"];
        let out = Command::new("git")
            .arg("-C")
            .arg(&self.path)
            .args(args)
            .env("GIT_AUTHOR_NAME", name)
            .env("GIT_AUTHOR_EMAIL", email)
            .env("GIT_AUTHOR_DATE", date)
            .env("GIT_COMMITTER_NAME", name)
            .env("GIT_COMMITTER_EMAIL", email)
            .env("GIT_COMMITTER_DATE", date)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .and_then(|mut child| {
                use std::io::Write;
                child.stdin.take().expect("piped").write_all(message.as_bytes())?;
                child.wait_with_output()
            })
            .map_err(|source| GitError::Spawn { command: args.join(" "), source })?;
        if !out.status.success() {
            return Err(GitError::failed(args.join(" "), &out));
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    }

    /// Moves the mainline from `old` to `new` only if it still points at `old`.
    pub fn move_mainline(&self, old: &str, new: &str) -> Result<(), GitError> {
        self.git(&["update-ref", "-m", "gantry queue: land", &self.mainline_ref(), new, old]).map(|_| ())
    }

    /// (files changed, lines added + removed) of a patch.
    pub fn diff_size(&self, patch: &Patch) -> Result<(u32, u32), GitError> {
        let out = self.git(&["diff", "--numstat", &patch.merge_base, &patch.head])?;
        let mut files = 0;
        let mut lines = 0;
        for l in out.lines() {
            let mut f = l.split('\t');
            let add = f.next().and_then(|n| n.parse::<u32>().ok()).unwrap_or(0);
            let del = f.next().and_then(|n| n.parse::<u32>().ok()).unwrap_or(0);
            files += 1;
            lines += add + del;
        }
        Ok((files, lines))
    }

    /// Paths a patch touches.
    pub fn changed_paths(&self, patch: &Patch) -> Result<Vec<String>, GitError> {
        Ok(self.git(&["diff", "--name-only", &patch.merge_base, &patch.head])?.lines().map(str::to_string).collect())
    }

    pub fn author(&self, commit: &str) -> Result<String, GitError> {
        self.git(&["log", "-1", "--format=%ae", commit])
    }

    /// Blob id of every file of a commit, by path: the source-file digests of the
    /// conflict analyzer.
    pub fn file_digests(&self, commit: &str) -> Result<std::collections::HashMap<String, String>, GitError> {
        let out = self.git(&["ls-tree", "-r", "--full-tree", commit])?;
        Ok(out
            .lines()
            .filter_map(|l| {
                let (meta, path) = l.split_once('\t')?;
                Some((path.to_string(), meta.split_whitespace().nth(2)?.to_string()))
            })
            .collect())
    }
}

pub fn short(commit: &str) -> &str {
    &commit[..commit.len().min(10)]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repo() -> (tempfile::TempDir, Repo) {
        let d = tempfile::tempdir().unwrap();
        let r = Repo::new(d.path(), "main");
        let run = |a: &[&str]| git(d.path(), a).unwrap();
        run(&["init", "--quiet", "-b", "main"]);
        run(&["config", "user.email", "dev@example.com"]);
        run(&["config", "user.name", "dev"]);
        std::fs::write(d.path().join("a.txt"), "1\n2\n3\n").unwrap();
        std::fs::write(d.path().join("b.txt"), "x\n").unwrap();
        run(&["add", "."]);
        run(&["commit", "--quiet", "-m", "base"]);
        (d, r)
    }

    fn branch(r: &Repo, name: &str, file: &str, text: &str) -> Patch {
        let run = |a: &[&str]| git(&r.path, a).unwrap();
        run(&["checkout", "--quiet", "-b", name, "main"]);
        std::fs::write(r.path.join(file), text).unwrap();
        run(&["commit", "--quiet", "-am", name]);
        run(&["checkout", "--quiet", "main"]);
        let (head, merge_base) = r.resolve(name).unwrap();
        Patch { merge_base, head, name: name.into() }
    }

    #[test]
    fn speculative_commits_are_deterministic_and_land_by_compare_and_swap() {
        let (_d, r) = repo();
        let main0 = r.head().unwrap();
        let a = branch(&r, "a", "a.txt", "1\n2\n3\nA\n");
        let b = branch(&r, "b", "b.txt", "y\n");
        let ca = r.apply(&a, &main0).unwrap();
        assert_eq!(ca, r.apply(&a, &main0).unwrap(), "same change on same parent, same commit");
        let cab = r.apply(&b, &ca).unwrap();
        assert_eq!(r.parent(&cab).unwrap(), ca);
        assert_eq!(git(&r.path, &["show", &format!("{cab}:b.txt")]).unwrap(), "y");
        assert_eq!(git(&r.path, &["show", &format!("{cab}:a.txt")]).unwrap(), "1\n2\n3\nA");
        r.move_mainline(&main0, &ca).unwrap();
        // A stale old value is refused, and the error says which command, how git exited
        // and what it said.
        let e = r.move_mainline(&main0, &cab).unwrap_err();
        let GitError::Failed { command, status, stderr } = &e else { panic!("{e:?}") };
        assert!(command.starts_with("update-ref ") && command.contains(&cab), "{e}");
        assert!(!status.success() && !stderr.is_empty(), "{e}");
        let message = e.to_string();
        assert!(message.starts_with("git update-ref ") && message.contains(stderr), "{message}");
        assert!(message.contains(&status.to_string()), "{message}");
        assert_eq!(r.head().unwrap(), ca);
        assert_eq!(r.diff_size(&a).unwrap(), (1, 1));
        assert_eq!(r.file_digests(&cab).unwrap().len(), 2);
    }

    #[test]
    fn conflicting_patches_and_bad_refs_are_explained() {
        let (_d, r) = repo();
        let main0 = r.head().unwrap();
        let a = branch(&r, "a", "a.txt", "1\nA\n3\n");
        let b = branch(&r, "b", "a.txt", "1\nB\n3\n");
        let ca = r.apply(&a, &main0).unwrap();
        let err = r.apply(&b, &ca).unwrap_err();
        assert!(matches!(&err, GitError::Conflict { files, .. } if files == &["a.txt"]), "{err:?}");
        assert_eq!(err.to_string(), format!("b does not apply on {}: conflicts in a.txt", short(&ca)));
        let bad_ref = |reference| match r.resolve(reference) {
            Err(GitError::BadRef(why)) => why,
            other => panic!("{reference}: {other:?}"),
        };
        assert!(bad_ref("nope").contains("not a branch or commit"));
        assert!(bad_ref("main").contains("nothing to land"));
        assert!(bad_ref("--all").contains("not a branch or commit"));
    }
}
