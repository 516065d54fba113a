//! The model's chat template (Jinja, rendered with `minijinja`): a chat
//! request's messages to the prompt text the model was trained on. From
//! `--chat-template` (a Jinja file), else the `chat_template` of the
//! `tokenizer_config.json` beside `--tokenizer`.

use std::path::Path;

use minijinja::{context, Environment, Error, ErrorKind};
use serde::Serialize;

/// Why a chat template could not be loaded or rendered.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("reading the chat template {path}: {message}")]
    Load { path: String, message: String },
    #[error("rendering the chat template: {0}")]
    Render(String),
}

/// One chat message, as the template sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// A compiled chat template and the special tokens it may name.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// A Jinja template file (`--chat-template`).
    pub fn from_file(path: &Path) -> Result<Self, TemplateError> {
        let source = read(path)?;
        Self::new(source, String::new(), String::new(), path)
    }

    /// `tokenizer_config.json`'s `chat_template` (a string) and its
    /// `bos_token`/`eos_token`; `None` when the file has no template.
    pub fn from_tokenizer_config(path: &Path) -> Result<Option<Self>, TemplateError> {
        let config: serde_json::Value =
            serde_json::from_str(&read(path)?).map_err(|e| TemplateError::Load {
                path: path.display().to_string(),
                message: e.to_string(),
            })?;
        let Some(source) = config["chat_template"].as_str() else {
            return Ok(None);
        };
        let token = |key: &str| {
            let v = &config[key];
            v.as_str()
                .or_else(|| v["content"].as_str())
                .unwrap_or_default()
                .to_owned()
        };
        Self::new(
            source.to_owned(),
            token("bos_token"),
            token("eos_token"),
            path,
        )
        .map(Some)
    }

    fn new(
        source: String,
        bos_token: String,
        eos_token: String,
        path: &Path,
    ) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        // HuggingFace templates call it to refuse a conversation.
        env.add_function(
            "raise_exception",
            |message: String| -> Result<String, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_template_owned("chat", source)
            .map_err(|e| TemplateError::Load {
                path: path.display().to_string(),
                message: e.to_string(),
            })?;
        Ok(Self {
            env,
            bos_token,
            eos_token,
        })
    }

    /// The prompt text of `messages`, ready for the assistant's turn.
    pub fn render(&self, messages: &[Message]) -> Result<String, TemplateError> {
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| TemplateError::Render(e.to_string()))?;
        template
            .render(context! {
                messages => messages,
                add_generation_prompt => true,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(|e| TemplateError::Render(e.to_string()))
    }
}

fn read(path: &Path) -> Result<String, TemplateError> {
    std::fs::read_to_string(path).map_err(|e| TemplateError::Load {
        path: path.display().to_string(),
        message: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_messages_with_the_special_tokens() {
        let dir = std::env::temp_dir().join(format!("sy-chat-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tokenizer_config.json");
        std::fs::write(
            &path,
            serde_json::json!({
                "bos_token": {"content": "<s>"},
                "eos_token": "</s>",
                "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}",
            })
            .to_string(),
        )
        .unwrap();
        let t = ChatTemplate::from_tokenizer_config(&path).unwrap().unwrap();
        let text = t
            .render(&[
                Message {
                    role: "system".into(),
                    content: "be brief".into(),
                },
                Message {
                    role: "user".into(),
                    content: "hi".into(),
                },
            ])
            .unwrap();
        assert_eq!(text, "<s>[system] be brief</s>[user] hi</s>[assistant]");
        std::fs::write(
            &path,
            r#"{"chat_template": "{{ raise_exception('no system') }}"}"#,
        )
        .unwrap();
        let t = ChatTemplate::from_tokenizer_config(&path).unwrap().unwrap();
        assert!(t.render(&[]).unwrap_err().to_string().contains("no system"));
        std::fs::write(&path, r#"{"bos_token": "<s>"}"#).unwrap();
        assert!(ChatTemplate::from_tokenizer_config(&path)
            .unwrap()
            .is_none());
        std::fs::remove_dir_all(&dir).ok();
    }
}
