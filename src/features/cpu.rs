//! CPU featuriser (stub, being written).
use super::Featuriser;
use crate::config::{FeatureSettings, FeatureShape};
use crate::decode::Waveform;
use half::f16;

pub struct CpuFeaturiser {
    shape: FeatureShape,
}

impl CpuFeaturiser {
    pub fn new(settings: &FeatureSettings, _threads: usize) -> anyhow::Result<Self> {
        Ok(CpuFeaturiser {
            shape: settings.shape(),
        })
    }
}

impl Featuriser for CpuFeaturiser {
    fn name(&self) -> String {
        "cpu".into()
    }
    fn shape(&self) -> FeatureShape {
        self.shape
    }
    fn featurise(&mut self, _batch: &[&Waveform], _out: &mut [f16]) -> anyhow::Result<()> {
        anyhow::bail!("not yet implemented")
    }
}
