//! Platform properties and matching: an action runs only on a worker whose properties
//! include every (name, value) pair the action asks for. An empty platform matches any
//! worker.

use gantry_core::reapi::Platform;

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Property {
    pub name: String,
    pub value: String,
}

pub fn from_platform(p: Option<&Platform>) -> Vec<Property> {
    let mut v: Vec<Property> = p
        .map(|p| p.properties.iter().map(|x| Property { name: x.name.clone(), value: x.value.clone() }).collect())
        .unwrap_or_default();
    v.sort();
    v.dedup();
    v
}

/// Whether a worker offering `offered` can run an action requiring `required`.
pub fn satisfies(offered: &[Property], required: &[Property]) -> bool {
    required.iter().all(|r| offered.contains(r))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(n: &str, v: &str) -> Property {
        Property { name: n.into(), value: v.into() }
    }

    #[test]
    fn matching() {
        let worker = vec![p("ISA", "x86-64"), p("OSFamily", "linux"), p("pool", "gpu")];
        assert!(satisfies(&worker, &[]), "empty platform matches any worker");
        assert!(satisfies(&worker, &[p("OSFamily", "linux")]));
        assert!(satisfies(&worker, &[p("OSFamily", "linux"), p("pool", "gpu")]));
        assert!(!satisfies(&worker, &[p("OSFamily", "windows")]));
        assert!(!satisfies(&worker, &[p("pool", "gpu"), p("cores", "64")]));
    }

    #[test]
    fn from_platform_sorts_and_dedups() {
        let plat = Platform {
            properties: vec![
                gantry_core::reapi::platform::Property { name: "b".into(), value: "1".into() },
                gantry_core::reapi::platform::Property { name: "a".into(), value: "2".into() },
                gantry_core::reapi::platform::Property { name: "b".into(), value: "1".into() },
            ],
        };
        assert_eq!(from_platform(Some(&plat)), vec![p("a", "2"), p("b", "1")]);
        assert!(from_platform(None).is_empty());
    }
}
