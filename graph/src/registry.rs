//! The registry of architectures, by their Hugging Face `architectures` name.

use crate::arch::{
    config::ConfigReader, deepseek, gemma3, llama, llama_with_draft, mistral, mixtral, phi3, qwen2,
    qwen3, Architecture, ModelSpec,
};
use crate::{Error, Result};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

/// Architectures by name, sorted.
#[derive(Clone, Default)]
pub struct Registry {
    entries: BTreeMap<&'static str, Arc<dyn Architecture>>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Every architecture maxc ships.
    pub fn builtin() -> Self {
        let mut r = Registry::new();
        let archs: [Arc<dyn Architecture>; 12] = [
            Arc::new(deepseek::DeepseekV2),
            Arc::new(deepseek::DeepseekV3),
            Arc::new(gemma3::Gemma3),
            Arc::new(gemma3::Gemma3ConditionalGeneration),
            Arc::new(llama::Llama),
            Arc::new(mistral::Mistral),
            Arc::new(qwen2::Qwen2),
            Arc::new(qwen3::Qwen3),
            Arc::new(qwen3::Qwen3Moe),
            Arc::new(mixtral::Mixtral),
            Arc::new(phi3::Phi3),
            Arc::new(llama_with_draft::LlamaWithDraft),
        ];
        for a in archs {
            r.register(a)
                .expect("built-in architecture names are distinct");
        }
        r
    }

    /// Adds `arch`; a name registered twice is an error.
    pub fn register(&mut self, arch: Arc<dyn Architecture>) -> Result<()> {
        let name = arch.name();
        if self.entries.contains_key(name) {
            return Err(Error::DuplicateArchitecture(name.into()));
        }
        self.entries.insert(name, arch);
        Ok(())
    }

    /// The registered architectures, sorted by name.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<dyn Architecture>> {
        self.entries.values()
    }

    /// The architecture named `name`; `source` says where the name came from, for the error.
    pub fn get(&self, name: &str, source: &str) -> Result<&Arc<dyn Architecture>> {
        self.entries
            .get(name)
            .ok_or_else(|| Error::UnknownArchitecture {
                name: name.into(),
                source_desc: source.into(),
                known: self.entries.keys().copied().collect::<Vec<_>>().join(", "),
            })
    }

    /// Parses a config.json value: finds its architecture (`architectures[0]`) and reads the
    /// config with it.
    pub fn parse_config(
        &self,
        file: &Path,
        config: &serde_json::Value,
    ) -> Result<Box<dyn ModelSpec>> {
        let reader = ConfigReader::new(file, config)?;
        let name = match reader.get("architectures") {
            Some(serde_json::Value::Array(names)) => names.first().and_then(|n| n.as_str()),
            _ => None,
        }
        .ok_or_else(|| {
            reader.error(
                "architectures",
                "missing; expected a list with the architecture's name",
            )
        })?;
        let arch = self.get(name, &format!("{} `architectures`", file.display()))?;
        arch.parse_config(&reader)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registering_a_name_twice_is_an_error() {
        let mut r = Registry::builtin();
        let err = r.register(Arc::new(llama::Llama)).unwrap_err();
        assert!(err.to_string().contains("LlamaForCausalLM"), "{err}");
    }

    #[test]
    fn unknown_architecture_lists_the_known_ones() {
        let cfg = serde_json::json!({"architectures": ["GPTNeoXForCausalLM"]});
        let err = Registry::builtin()
            .parse_config(Path::new("m/config.json"), &cfg)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("GPTNeoXForCausalLM")
                && err.contains("LlamaForCausalLM")
                && err.contains("m/config.json"),
            "{err}"
        );
    }
}
