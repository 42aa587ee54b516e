//! GGUF metadata values: the thirteen value types and their decoded form.

use std::fmt;

/// A metadata value type, by its on-disk id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    pub const ALL: [ValueType; 13] = [
        ValueType::U8,
        ValueType::I8,
        ValueType::U16,
        ValueType::I16,
        ValueType::U32,
        ValueType::I32,
        ValueType::F32,
        ValueType::Bool,
        ValueType::String,
        ValueType::Array,
        ValueType::U64,
        ValueType::I64,
        ValueType::F64,
    ];

    pub fn from_id(id: u32) -> Option<ValueType> {
        ValueType::ALL.iter().copied().find(|t| *t as u32 == id)
    }

    pub fn id(self) -> u32 {
        self as u32
    }

    /// The fewest bytes one value of this type takes on disk (a string is at least its length,
    /// an array at least its element type and count). Bounds counts before allocating.
    pub fn min_size(self) -> u64 {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }

    /// gguf-py's name for the type (`GGUFValueType`).
    pub fn name(self) -> &'static str {
        use ValueType::*;
        match self {
            U8 => "UINT8",
            I8 => "INT8",
            U16 => "UINT16",
            I16 => "INT16",
            U32 => "UINT32",
            I32 => "INT32",
            F32 => "FLOAT32",
            Bool => "BOOL",
            String => "STRING",
            Array => "ARRAY",
            U64 => "UINT64",
            I64 => "INT64",
            F64 => "FLOAT64",
        }
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A decoded metadata value. Arrays hold elements of one non-array type.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(ValueType, Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(..) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    /// Any integer type as i128, so that every width compares and range-checks the same way
    /// (real files store hparams as u32 where the spec says u64).
    pub fn as_int(&self) -> Option<i128> {
        Some(match *self {
            Value::U8(v) => v.into(),
            Value::I8(v) => v.into(),
            Value::U16(v) => v.into(),
            Value::I16(v) => v.into(),
            Value::U32(v) => v.into(),
            Value::I32(v) => v.into(),
            Value::U64(v) => v.into(),
            Value::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// An integer of any width that fits in `T`: `None` for non-integers, `Err` out of range.
    pub fn to_int<T: TryFrom<i128>>(&self) -> Option<Result<T, i128>> {
        let v = self.as_int()?;
        Some(T::try_from(v).map_err(|_| v))
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<(ValueType, &[Value])> {
        match self {
            Value::Array(t, v) => Some((*t, v)),
            _ => None,
        }
    }

    /// The complete value as JSON, floats as numbers (non-finite ones as strings).
    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::Value as J;
        let float = |f: f64| {
            serde_json::Number::from_f64(f)
                .map(J::Number)
                .unwrap_or_else(|| J::String(f.to_string()))
        };
        match self {
            Value::F32(v) => float((*v).into()),
            Value::F64(v) => float(*v),
            Value::Bool(b) => J::Bool(*b),
            Value::String(s) => J::String(s.clone()),
            Value::Array(_, items) => J::Array(items.iter().map(Value::to_json).collect()),
            Value::U64(v) => J::from(*v),
            Value::I64(v) => J::from(*v),
            other => match other.as_int() {
                Some(i) => J::from(i as i64),
                None => J::Null,
            },
        }
    }

    /// One line for `kiln inspect`: arrays longer than `max_items` show their first items and
    /// their length.
    pub fn summary(&self, max_items: usize) -> String {
        match self {
            Value::Array(t, items) => {
                let shown: Vec<String> = items
                    .iter()
                    .take(max_items)
                    .map(|v| v.summary(max_items))
                    .collect();
                let more = if items.len() > max_items { ", …" } else { "" };
                format!("[{t}; {}] [{}{more}]", items.len(), shown.join(", "))
            }
            Value::String(s) => {
                let mut out: String = s.chars().take(120).collect();
                if out.len() < s.len() {
                    out.push('…');
                }
                format!("{out:?}")
            }
            Value::F32(v) => format!("{v:?}"),
            Value::F64(v) => format!("{v:?}"),
            Value::Bool(b) => b.to_string(),
            other => other.as_int().map(|i| i.to_string()).unwrap_or_default(),
        }
    }
}
