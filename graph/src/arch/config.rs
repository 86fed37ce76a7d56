//! Reading config.json as transformers 4 and 5 write it, with errors that name the field.

use crate::{DType, Error, Result};
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

/// A view of one JSON object of a config file, that reads fields with errors naming the file and
/// the field's full path (`text_config.hidden_size`).
#[derive(Clone, Debug)]
pub struct ConfigReader<'a> {
    file: PathBuf,
    path: String,
    obj: &'a Map<String, Value>,
}

impl<'a> ConfigReader<'a> {
    /// The reader of the top-level object of `value`, read from `file`.
    pub fn new(file: &Path, value: &'a Value) -> Result<Self> {
        let obj = value
            .as_object()
            .ok_or_else(|| Error::config(file, "<root>", "expected a JSON object"))?;
        Ok(ConfigReader {
            file: file.to_path_buf(),
            path: String::new(),
            obj,
        })
    }

    /// A reader of `value` whose errors name its fields as `path.<key>` (a section of the
    /// config that the caller has completed, such as a `text_config` with its defaults).
    pub fn nested(file: &Path, path: &str, value: &'a Value) -> Result<Self> {
        let obj = value
            .as_object()
            .ok_or_else(|| Error::config(file, path, "expected a JSON object"))?;
        Ok(ConfigReader {
            file: file.to_path_buf(),
            path: path.to_string(),
            obj,
        })
    }

    /// The fields this reader reads.
    pub fn fields(&self) -> &'a Map<String, Value> {
        self.obj
    }

    /// The file the config came from.
    pub fn file(&self) -> &Path {
        &self.file
    }

    fn field_path(&self, key: &str) -> String {
        if self.path.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.path)
        }
    }

    /// An error about `key`.
    pub fn error(&self, key: &str, message: impl Into<String>) -> Error {
        Error::config(&self.file, self.field_path(key), message)
    }

    /// The value of `key`; absent and `null` are both `None` (transformers writes either).
    pub fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    /// A nested object, if present.
    pub fn child(&self, key: &str) -> Result<Option<ConfigReader<'a>>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Object(obj)) => Ok(Some(ConfigReader {
                file: self.file.clone(),
                path: self.field_path(key),
                obj,
            })),
            Some(other) => Err(self.error(key, format!("expected an object, found {other}"))),
        }
    }

    /// A required nested object.
    pub fn require_child(&self, key: &str) -> Result<ConfigReader<'a>> {
        self.child(key)?
            .ok_or_else(|| self.error(key, "missing; expected an object"))
    }

    /// An optional non-negative integer.
    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| {
                    self.error(key, format!("expected a non-negative integer, found {v}"))
                }),
        }
    }

    /// A required integer of at least 1.
    pub fn positive(&self, key: &str) -> Result<usize> {
        match self.opt_usize(key)? {
            None => Err(self.error(key, "missing; expected a positive integer")),
            Some(0) => Err(self.error(key, "is 0; expected a positive integer")),
            Some(n) => Ok(n),
        }
    }

    /// An optional number.
    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.error(key, format!("expected a number, found {v}"))),
        }
    }

    /// An optional boolean.
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.error(key, format!("expected true or false, found {v}"))),
        }
    }

    /// An optional string.
    pub fn opt_str(&self, key: &str) -> Result<Option<&'a str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.error(key, format!("expected a string, found {v}"))),
        }
    }

    /// The checkpoint's dtype: `dtype` (transformers 5) or `torch_dtype` (transformers 4).
    pub fn checkpoint_dtype(&self) -> Result<Option<DType>> {
        for key in ["dtype", "torch_dtype"] {
            if let Some(s) = self.opt_str(key)? {
                return s.parse().map(Some).map_err(|e: String| self.error(key, e));
            }
        }
        Ok(None)
    }
}
