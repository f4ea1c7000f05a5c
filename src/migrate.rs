//! Migrations: the version check run whenever a persisted store is opened, and the upgrade
//! steps between versions. The layouts themselves are described in `migrations/`.

use crate::manifest::{ManifestError, MANIFEST_SCHEMA_VERSION};
use crate::output::OUTPUT_SCHEMA_VERSION;

/// Refuse a manifest newer than this binary; upgrade an older one (none exist yet: version 1
/// is the first).
pub fn check_manifest_version(path: &str, found: u32) -> Result<(), ManifestError> {
    if found > MANIFEST_SCHEMA_VERSION {
        return Err(ManifestError::TooNew {
            path: path.to_string(),
            found,
            supported: MANIFEST_SCHEMA_VERSION,
        });
    }
    if found == 0 {
        return Err(ManifestError::Unknown {
            path: path.to_string(),
            found: found.to_string(),
        });
    }
    Ok(())
}

/// The same rule for an output file's `schema_version` attribute.
pub fn check_output_version(path: &str, found: u32) -> anyhow::Result<()> {
    if found > OUTPUT_SCHEMA_VERSION {
        anyhow::bail!(
            "{path}: output schema version {found} is newer than this ailhd supports ({OUTPUT_SCHEMA_VERSION}): upgrade ailhd or run `ailhd rebuild`"
        );
    }
    if found == 0 {
        anyhow::bail!("{path}: unknown output schema version {found}: run `ailhd rebuild`");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn newest(prefix: &str) -> u32 {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
        std::fs::read_dir(dir)
            .unwrap()
            .filter_map(|e| {
                let name = e.unwrap().file_name().into_string().unwrap();
                name.strip_prefix(prefix)?.strip_suffix(".md")?.parse().ok()
            })
            .max()
            .unwrap()
    }

    #[test]
    fn code_versions_match_the_newest_description() {
        assert_eq!(newest("manifest-v"), MANIFEST_SCHEMA_VERSION);
        assert_eq!(newest("outputs-v"), OUTPUT_SCHEMA_VERSION);
    }

    #[test]
    fn newer_and_zero_versions_are_refused() {
        assert!(check_manifest_version("m", MANIFEST_SCHEMA_VERSION).is_ok());
        assert!(check_manifest_version("m", MANIFEST_SCHEMA_VERSION + 1).is_err());
        assert!(check_manifest_version("m", 0).is_err());
        assert!(check_output_version("o", OUTPUT_SCHEMA_VERSION + 1)
            .unwrap_err()
            .to_string()
            .contains("newer"));
    }
}
