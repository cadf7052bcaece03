//! Stand-ins for core APIs that have not landed on main yet (`cpu::eval`, `HostTensor`,
//! `autodiff::backward`); each is replaced by a re-export as soon as it lands.

use rumble_core::{Tensor, TensorType, Trace};

/// A tensor on the host: its type and its little-endian bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    pub ty: TensorType,
    pub bytes: Vec<u8>,
}

pub fn cpu_eval(trace: &Trace, _inputs: &[HostTensor]) -> rumble_core::Result<Vec<HostTensor>> {
    Err(rumble_core::Error::Unsupported {
        backend: "cpu".into(),
        what: format!("trace `{}` (cpu::eval not landed)", trace.name),
    })
}

pub fn backward(_loss: &Tensor, _wrt: &[&Tensor]) -> rumble_core::Result<Vec<Tensor>> {
    Err(rumble_core::Error::Autodiff("autodiff::backward has not landed".into()))
}
