//! Errors of the frontend: invalid model configurations and unreadable Hugging Face configs.

/// Everything that can go wrong turning a model description into a graph.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FrontendError {
    /// A configuration value is out of range or inconsistent; the message says what to change.
    #[error("{0}")]
    InvalidConfig(String),
    /// A preset name that does not exist.
    #[error("unknown preset `{0}`; choose one of debug, 1b, 3b, 8b, 70b, 405b")]
    UnknownPreset(String),
    /// A model family `titanc new` does not know.
    #[error("unknown model family `{0}`; choose one of: llama3")]
    UnknownFamily(String),
    /// A Hugging Face `config.json` that is malformed or describes something unsupported.
    #[error("{file}: {message}")]
    HfConfig { file: String, message: String },
    /// A file that cannot be read.
    #[error("cannot read `{file}`: {message}")]
    Io { file: String, message: String },
    /// The builder produced an ill-typed node: a bug in the frontend, not in the input.
    #[error("internal error while building the graph (please report it): {0}")]
    Build(String),
}

impl FrontendError {
    pub(crate) fn invalid(message: impl Into<String>) -> FrontendError {
        FrontendError::InvalidConfig(message.into())
    }
}
