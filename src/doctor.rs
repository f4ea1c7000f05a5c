//! doctor (placeholder until the GPU branch lands).
pub fn run_doctor(_f: &crate::config::FeatureSettings, _json: bool) -> anyhow::Result<()> {
    anyhow::bail!("not yet")
}
