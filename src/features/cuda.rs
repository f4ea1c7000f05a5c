//! CUDA featuriser (stub, being written).
use super::Featuriser;
use crate::config::{FeatureSettings, FeatureShape};
use crate::decode::Waveform;
use half::f16;

pub struct CudaFeaturiser {
    #[allow(dead_code)]
    shape: FeatureShape,
}

impl CudaFeaturiser {
    pub fn new(settings: &FeatureSettings) -> anyhow::Result<Self> {
        let _ = settings;
        anyhow::bail!("CUDA featuriser not yet implemented")
    }
}

impl Featuriser for CudaFeaturiser {
    fn name(&self) -> String {
        "cuda".into()
    }
    fn shape(&self) -> FeatureShape {
        self.shape
    }
    fn featurise(&mut self, _batch: &[&Waveform], _out: &mut [f16]) -> anyhow::Result<()> {
        anyhow::bail!("not yet implemented")
    }
}
