//! Who is calling, and what they may do: the identities and grants of `[auth]`, and the
//! one authorization decision every service makes (`require`), as pure functions.
//!
//! The server's authentication layer (gantry-services) turns credentials into an
//! [`Caller`] in the request's extensions; services then ask `require(&request,
//! permission, instance)`. A request that carries no `Caller` comes from a server without
//! `[auth]`, which allows everything, as gantry did before authentication existed.

use std::collections::BTreeSet;
use std::sync::Arc;

use crate::{Error, Result};

/// What a call may do. Names are those of `[auth.grants.*] permissions`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Permission {
    /// Read the CAS and the action cache (and capabilities).
    Read,
    /// Upload blobs.
    WriteCas,
    /// Write action-cache entries directly (UpdateActionResult). Results of remote
    /// execution are written by gantry itself and need no such permission.
    WriteAc,
    /// Run actions, and follow one's own operations.
    Execute,
    /// The batching service: enqueue targets, list and watch builds.
    Batch,
    /// The submit queue: submit, watch, cancel one's changes.
    Queue,
    /// Other callers' operations, model training, anything that acts for everyone.
    Admin,
}

impl Permission {
    pub const ALL: [Permission; 7] = [
        Permission::Read,
        Permission::WriteCas,
        Permission::WriteAc,
        Permission::Execute,
        Permission::Batch,
        Permission::Queue,
        Permission::Admin,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Permission::Read => "read",
            Permission::WriteCas => "write_cas",
            Permission::WriteAc => "write_ac",
            Permission::Execute => "execute",
            Permission::Batch => "batch",
            Permission::Queue => "queue",
            Permission::Admin => "admin",
        }
    }

    pub fn parse(name: &str) -> Option<Permission> {
        Permission::ALL.into_iter().find(|p| p.name() == name)
    }
}

/// Permissions on a set of instance names. A pattern is `*` (every instance), a name
/// (`main`, or `""` for the default instance), or a prefix ending in `/*` (`dev/*`: every
/// instance under `dev/`, not `dev` itself).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    pub name: String,
    pub instances: Vec<String>,
    pub permissions: BTreeSet<Permission>,
}

impl Grant {
    pub fn covers(&self, permission: Permission, instance: &str) -> bool {
        self.permissions.contains(&permission) && self.instances.iter().any(|p| instance_matches(p, instance))
    }
}

/// Whether instance name `instance` matches `pattern` (see [`Grant`]).
pub fn instance_matches(pattern: &str, instance: &str) -> bool {
    if pattern == "*" {
        return true;
    }
    match pattern.strip_suffix("/*") {
        Some(prefix) => {
            instance.len() > prefix.len() + 1
                && instance.starts_with(prefix)
                && instance.as_bytes()[prefix.len()] == b'/'
        }
        None => pattern == instance,
    }
}

/// Whether an identity runs actions (a worker) or asks for them (a client). The two never
/// mix: a worker credential only registers workers and reads and writes the CAS for its
/// actions; a client credential registers no worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Principal {
    Client,
    Worker,
}

/// An authenticated caller (or the anonymous one, when `[auth] anonymous` allows it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    /// The credential's configured name (`ci`, `anonymous`, a worker's name), for logs.
    pub name: String,
    pub principal: Principal,
    pub grants: Arc<Vec<Grant>>,
}

impl Identity {
    /// The decision: may this identity do `permission` on `instance`? The refusal names
    /// the permission and the instance the caller asked for, nothing about what exists.
    pub fn check(&self, permission: Permission, instance: &str) -> Result<()> {
        let allowed = match self.principal {
            Principal::Client => self.grants.iter().any(|g| g.covers(permission, instance)),
            // A worker fetches its actions' inputs and uploads their outputs: the CAS,
            // and nothing a client does (no action cache writes, no Execute).
            Principal::Worker => matches!(permission, Permission::Read | Permission::WriteCas),
        };
        if allowed {
            return Ok(());
        }
        Err(Error::PermissionDenied(format!(
            "permission '{}' on instance '{instance}' is not granted to '{}'",
            permission.name(),
            self.name
        )))
    }
}

/// Who made a request, as the server's authentication layer found it.
#[derive(Clone, Debug)]
pub enum Caller {
    /// The server runs without `[auth]`: everything is allowed.
    Unrestricted,
    Identity(Arc<Identity>),
}

/// The caller of `req`: `Unrestricted` when no authentication layer marked it.
pub fn caller<T>(req: &tonic::Request<T>) -> Caller {
    req.extensions().get::<Caller>().cloned().unwrap_or(Caller::Unrestricted)
}

/// Allows the request if its caller may do `permission` on `instance`.
pub fn require<T>(req: &tonic::Request<T>, permission: Permission, instance: &str) -> Result<(), tonic::Status> {
    check(&caller(req), permission, instance).map_err(Into::into)
}

/// [`require`] on a caller already taken out of its request (streams that learn their
/// instance name from a later message).
pub fn check(caller: &Caller, permission: Permission, instance: &str) -> Result<()> {
    match caller {
        Caller::Unrestricted => Ok(()),
        Caller::Identity(id) => id.check(permission, instance),
    }
}

/// Allows the request if its caller has `permission` on at least one instance: for calls
/// that name an operation rather than an instance (WaitExecution, GetOperation). The
/// operation's name is an unguessable capability handed to the client that started it.
pub fn require_somewhere<T>(req: &tonic::Request<T>, permission: Permission) -> Result<(), tonic::Status> {
    check_somewhere(&caller(req), permission).map_err(tonic::Status::from)
}

/// The decision behind [`require_somewhere`]: a client granted `permission` on some instance.
pub fn check_somewhere(caller: &Caller, permission: Permission) -> Result<()> {
    match caller {
        Caller::Unrestricted => Ok(()),
        Caller::Identity(id)
            if id.principal == Principal::Client && id.grants.iter().any(|g| g.permissions.contains(&permission)) =>
        {
            Ok(())
        }
        Caller::Identity(id) => Err(Error::PermissionDenied(format!(
            "permission '{}' is not granted to '{}' on any instance",
            permission.name(),
            id.name
        ))),
    }
}

/// Allows the request only from a worker credential (or an unrestricted server).
pub fn require_worker<T>(req: &tonic::Request<T>) -> Result<(), tonic::Status> {
    match caller(req) {
        Caller::Unrestricted => Ok(()),
        Caller::Identity(id) if id.principal == Principal::Worker => Ok(()),
        Caller::Identity(id) => Err(tonic::Status::permission_denied(format!(
            "'{}' is not a worker credential: only [auth.workers] credentials may register workers",
            id.name
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant(instances: &[&str], perms: &[Permission]) -> Grant {
        Grant {
            name: "g".into(),
            instances: instances.iter().map(|s| s.to_string()).collect(),
            permissions: perms.iter().copied().collect(),
        }
    }

    fn id(principal: Principal, grants: Vec<Grant>) -> Identity {
        Identity { name: "dev".into(), principal, grants: Arc::new(grants) }
    }

    #[test]
    fn instance_patterns() {
        assert!(instance_matches("*", ""));
        assert!(instance_matches("*", "a/b"));
        assert!(instance_matches("main", "main"));
        assert!(!instance_matches("main", "main/x"));
        assert!(instance_matches("", ""));
        assert!(!instance_matches("", "main"));
        assert!(instance_matches("dev/*", "dev/alice"));
        assert!(instance_matches("dev/*", "dev/a/b"));
        assert!(!instance_matches("dev/*", "dev"));
        assert!(!instance_matches("dev/*", "dev/"));
        assert!(!instance_matches("dev/*", "devx/a"));
        assert!(!instance_matches("dev/*", "main"));
    }

    #[test]
    fn decisions() {
        let dev = id(
            Principal::Client,
            vec![grant(&["main", "dev/*"], &[Permission::Read, Permission::WriteCas, Permission::Execute])],
        );
        assert!(dev.check(Permission::Read, "main").is_ok());
        assert!(dev.check(Permission::Execute, "dev/alice").is_ok());
        let e = dev.check(Permission::WriteAc, "main").unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(e.to_string().contains("write_ac") && e.to_string().contains("'main'"), "{e}");
        assert!(dev.check(Permission::Read, "prod").is_err(), "another instance");
        // Grants add up.
        let both =
            id(Principal::Client, vec![grant(&["a"], &[Permission::Read]), grant(&["b"], &[Permission::WriteAc])]);
        assert!(both.check(Permission::Read, "a").is_ok() && both.check(Permission::WriteAc, "b").is_ok());
        assert!(both.check(Permission::WriteAc, "a").is_err());
        // A worker credential reaches the CAS for its actions and nothing else, whatever
        // grants it were given.
        let worker = id(Principal::Worker, vec![grant(&["*"], &Permission::ALL)]);
        assert!(worker.check(Permission::Read, "").is_ok() && worker.check(Permission::WriteCas, "x").is_ok());
        for p in [Permission::WriteAc, Permission::Execute, Permission::Batch, Permission::Queue, Permission::Admin] {
            assert!(worker.check(p, "").is_err(), "{p:?}");
        }
        assert!(check(&Caller::Unrestricted, Permission::Admin, "x").is_ok());
    }

    #[test]
    fn permission_names_round_trip() {
        for p in Permission::ALL {
            assert_eq!(Permission::parse(p.name()), Some(p));
        }
        assert_eq!(Permission::parse("root"), None);
    }
}
