//! The one check of an output's layout version (`schema_version`: the HDF5 attribute, npy
//! `attributes.json`), for every reader of outputs: the sinks reopening them to append,
//! `merge` reading its inputs, and [`crate::migrate`]. No upgrade of the output layout exists
//! (`migrations/`): any other version than [`OUTPUT_SCHEMA_VERSION`] is refused.

use super::OUTPUT_SCHEMA_VERSION;
use std::path::Path;

/// Refuse an output file whose layout version is not [`OUTPUT_SCHEMA_VERSION`]. `found`: the
/// version it records, or why none could be read. The error names the file, the version found
/// and the one supported.
pub fn check_output_version(path: &Path, found: Result<u64, String>) -> anyhow::Result<()> {
    let supported = OUTPUT_SCHEMA_VERSION;
    let path = path.display();
    match found {
        Ok(v) if v == u64::from(supported) => Ok(()),
        Ok(v) if v > u64::from(supported) => anyhow::bail!(
            "{path}: output layout version {v} is newer than this ailhd supports ({supported}): \
             upgrade ailhd or run `ailhd rebuild` to regenerate the outputs"
        ),
        Ok(v) => anyhow::bail!(
            "{path}: output layout version {v}, this ailhd reads and writes version {supported} \
             only: run `ailhd rebuild` to regenerate the outputs"
        ),
        Err(why) => anyhow::bail!(
            "{path}: no readable schema_version ({why}): not an ailhd output of layout version \
             {supported}; run `ailhd rebuild` to regenerate the outputs"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_this_layout_version_passes_and_errors_name_file_and_versions() {
        let p = Path::new("/out/training.h5");
        let v = u64::from(OUTPUT_SCHEMA_VERSION);
        assert!(check_output_version(p, Ok(v)).is_ok());
        let newer = check_output_version(p, Ok(v + 1)).unwrap_err().to_string();
        assert!(newer.contains("/out/training.h5"), "{newer}");
        assert!(newer.contains("newer"), "{newer}");
        assert!(newer.contains(&format!("version {}", v + 1)), "{newer}");
        assert!(newer.contains(&format!("({v})")), "{newer}");
        let zero = check_output_version(p, Ok(0)).unwrap_err().to_string();
        assert!(
            zero.contains("version 0") && zero.contains(&format!("version {v}")),
            "{zero}"
        );
        let missing = check_output_version(p, Err("no attribute".into()))
            .unwrap_err()
            .to_string();
        assert!(
            missing.contains("no readable schema_version (no attribute)"),
            "{missing}"
        );
        assert!(missing.contains("/out/training.h5"), "{missing}");
    }
}
