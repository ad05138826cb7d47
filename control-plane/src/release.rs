//! Version skew between agents and the control plane, as `gpuctl nodes` flags it.
//!
//! The policy (docs/UPGRADING.md): the control plane is upgraded first, and an agent may lag
//! it by one minor release while a fleet rolls out; an agent two releases behind, or newer
//! than the control plane, is outside what is tested. Releases before 0.2 did not report a
//! release: they count as 0.1.

use std::fmt;

/// A release as major.minor (patch releases never change what crosses the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Release {
    pub major: u32,
    pub minor: u32,
}

impl Release {
    /// "0.2.0" → 0.2; an empty release is an agent from before 0.2, which said none.
    pub fn parse(text: &str) -> Option<Release> {
        if text.is_empty() {
            return Some(Release { major: 0, minor: 1 });
        }
        let mut parts = text.split(['.', '-', '+']);
        let major = parts.next()?.parse().ok()?;
        let minor = parts.next()?.parse().ok()?;
        Some(Release { major, minor })
    }

    /// Minor releases from `self` up to `newer` (negative when `newer` is older); releases of
    /// different majors are never within skew.
    fn minors_behind(self, newer: Release) -> Option<i64> {
        (self.major == newer.major).then(|| i64::from(newer.minor) - i64::from(self.minor))
    }
}

/// How an agent's release stands against the control plane's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Skew {
    Same,
    /// One minor release behind: supported during a rollout.
    OneBehind,
    /// Further behind, newer than the control plane, another major, or unreadable.
    Unsupported,
}

impl Skew {
    pub fn of(agent: &str, control_plane: &str) -> Skew {
        let (Some(agent), Some(cp)) = (Release::parse(agent), Release::parse(control_plane)) else {
            return Skew::Unsupported;
        };
        match agent.minors_behind(cp) {
            Some(0) => Skew::Same,
            Some(1) => Skew::OneBehind,
            _ => Skew::Unsupported,
        }
    }
}

impl fmt::Display for Skew {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Skew::Same => "",
            Skew::OneBehind => "skew",
            Skew::Unsupported => "UNSUPPORTED-SKEW",
        })
    }
}

/// An agent's release for a table: "0.2.0", or "<0.2" for one that did not report it.
pub fn agent_release_text(release: &str) -> String {
    if release.is_empty() {
        "<0.2".to_owned()
    } else {
        release.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn releases_parse_as_major_minor() {
        assert_eq!(
            Release::parse("0.2.0"),
            Some(Release { major: 0, minor: 2 })
        );
        assert_eq!(
            Release::parse("1.12.3-rc1"),
            Some(Release {
                major: 1,
                minor: 12
            })
        );
        assert_eq!(Release::parse(""), Some(Release { major: 0, minor: 1 }));
        assert_eq!(Release::parse("x"), None);
        assert_eq!(Release::parse("1"), None);
    }

    #[test]
    fn skew_follows_the_policy() {
        assert_eq!(Skew::of("0.2.0", "0.2.3"), Skew::Same);
        assert_eq!(Skew::of("0.1.0", "0.2.0"), Skew::OneBehind);
        assert_eq!(
            Skew::of("", "0.2.0"),
            Skew::OneBehind,
            "an agent before 0.2"
        );
        assert_eq!(Skew::of("", "0.3.0"), Skew::Unsupported);
        assert_eq!(Skew::of("0.1.0", "0.3.0"), Skew::Unsupported);
        assert_eq!(Skew::of("0.3.0", "0.2.0"), Skew::Unsupported, "newer agent");
        assert_eq!(
            Skew::of("1.0.0", "0.9.0"),
            Skew::Unsupported,
            "another major"
        );
        assert_eq!(Skew::of("garbage", "0.2.0"), Skew::Unsupported);
    }
}
