//! Host tensors of the reference interpreter: the `Real` element trait (f32 or f64, with a
//! GEMM hook), tensor data (floats in `T`, integers as i64) and a safe strided GEMM wrapper.

use std::fmt::Debug;

use num_traits::Float;

use crate::dtype::DType;

/// The element type the interpreter computes in: `f32` (the default, as fast as the CPU
/// allows) or `f64` (exact enough for finite-difference gradient checks).
pub trait Real: Float + Copy + Send + Sync + Debug + Default + 'static {
    fn from_f64(x: f64) -> Self;
    fn to_f64(self) -> f64;

    /// `C <- alpha * A B + beta * C` on strided matrices (`A` is `m x k`, `B` is `k x n`,
    /// `C` is `m x n`); the hook into `matrixmultiply::{sgemm, dgemm}`. With `beta == 0`,
    /// `C` is overwritten without being read. Use [`gemm`] instead, which checks bounds.
    ///
    /// # Safety
    /// Every element the strides address must lie inside the allocations behind `a`, `b`
    /// and `c`, and `c` must not overlap `a` or `b`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn gemm_raw(
        m: usize,
        k: usize,
        n: usize,
        alpha: Self,
        a: *const Self,
        rsa: isize,
        csa: isize,
        b: *const Self,
        rsb: isize,
        csb: isize,
        beta: Self,
        c: *mut Self,
        rsc: isize,
        csc: isize,
    );
}

impl Real for f32 {
    fn from_f64(x: f64) -> Self {
        x as f32
    }

    fn to_f64(self) -> f64 {
        f64::from(self)
    }

    unsafe fn gemm_raw(
        m: usize,
        k: usize,
        n: usize,
        alpha: f32,
        a: *const f32,
        rsa: isize,
        csa: isize,
        b: *const f32,
        rsb: isize,
        csb: isize,
        beta: f32,
        c: *mut f32,
        rsc: isize,
        csc: isize,
    ) {
        // SAFETY: forwarded from the caller's contract.
        unsafe { matrixmultiply::sgemm(m, k, n, alpha, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc) }
    }
}

impl Real for f64 {
    fn from_f64(x: f64) -> Self {
        x
    }

    fn to_f64(self) -> f64 {
        self
    }

    unsafe fn gemm_raw(
        m: usize,
        k: usize,
        n: usize,
        alpha: f64,
        a: *const f64,
        rsa: isize,
        csa: isize,
        b: *const f64,
        rsb: isize,
        csb: isize,
        beta: f64,
        c: *mut f64,
        rsc: isize,
        csc: isize,
    ) {
        // SAFETY: forwarded from the caller's contract.
        unsafe { matrixmultiply::dgemm(m, k, n, alpha, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc) }
    }
}

/// A read-only strided matrix view: element `(i, j)` is `data[off + i * rs + j * cs]`.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a, T> {
    pub data: &'a [T],
    pub off: usize,
    pub rs: usize,
    pub cs: usize,
}

/// A writable strided matrix view: element `(i, j)` is `data[off + i * rs + j * cs]`.
#[derive(Debug)]
pub struct MatMut<'a, T> {
    pub data: &'a mut [T],
    pub off: usize,
    pub rs: usize,
    pub cs: usize,
}

/// Whether a `rows x cols` view with these strides stays inside `len` elements.
fn view_fits(len: usize, off: usize, rows: usize, cols: usize, rs: usize, cs: usize) -> bool {
    if rows == 0 || cols == 0 {
        return true;
    }
    let last = (rows - 1).checked_mul(rs).and_then(|r| (cols - 1).checked_mul(cs).and_then(|c| r.checked_add(c))).and_then(|x| x.checked_add(off));
    matches!(last, Some(l) if l < len && rs <= isize::MAX as usize && cs <= isize::MAX as usize)
}

/// `C <- alpha * A B + beta * C` for `A: m x k`, `B: k x n`, `C: m x n` strided views, one
/// `matrixmultiply` call. Transposes are expressed by swapping a view's strides.
///
/// # Panics
/// If a view addresses elements outside its slice (a bug in the caller, which validates
/// shapes first).
#[allow(clippy::too_many_arguments)]
pub fn gemm<T: Real>(m: usize, k: usize, n: usize, alpha: T, a: MatRef<'_, T>, b: MatRef<'_, T>, beta: T, c: MatMut<'_, T>) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(view_fits(c.data.len(), c.off, m, n, c.rs, c.cs), "invariant: gemm output view out of bounds");
    if k == 0 {
        for i in 0..m {
            for j in 0..n {
                let x = &mut c.data[c.off + i * c.rs + j * c.cs];
                *x = if beta == T::zero() { T::zero() } else { beta * *x };
            }
        }
        return;
    }
    assert!(view_fits(a.data.len(), a.off, m, k, a.rs, a.cs), "invariant: gemm lhs view out of bounds");
    assert!(view_fits(b.data.len(), b.off, k, n, b.rs, b.cs), "invariant: gemm rhs view out of bounds");
    // SAFETY: the three views were checked to lie inside their slices, strides fit in isize,
    // and `c` is a unique borrow so it cannot overlap the shared `a` and `b`.
    unsafe {
        T::gemm_raw(
            m,
            k,
            n,
            alpha,
            a.data.as_ptr().add(a.off),
            a.rs as isize,
            a.cs as isize,
            b.data.as_ptr().add(b.off),
            b.rs as isize,
            b.cs as isize,
            beta,
            c.data.as_mut_ptr().add(c.off),
            c.rs as isize,
            c.cs as isize,
        )
    }
}

/// The elements of a tensor: floats in the computation type, integers as i64 (i32-typed
/// values are kept in i32 range).
#[derive(Clone, Debug, PartialEq)]
pub enum Data<T> {
    Float(Vec<T>),
    Int(Vec<i64>),
}

impl<T> Data<T> {
    pub fn len(&self) -> usize {
        match self {
            Data::Float(v) => v.len(),
            Data::Int(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A dense row-major tensor on the host.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor<T> {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: Data<T>,
}

pub(crate) fn shape_str(shape: &[usize]) -> String {
    let parts: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    format!("[{}]", parts.join(", "))
}

fn check_i32(v: &[i64]) -> Result<(), String> {
    match v.iter().find(|&&x| i32::try_from(x).is_err()) {
        Some(x) => Err(format!("value {x} does not fit in i32")),
        None => Ok(()),
    }
}

impl<T: Real> Tensor<T> {
    /// A tensor of zeros (integer zeros for integer dtypes).
    pub fn zeros(dtype: DType, shape: impl Into<Vec<usize>>) -> Self {
        let shape = shape.into();
        let n = shape.iter().product();
        let data = if dtype.is_int() { Data::Int(vec![0; n]) } else { Data::Float(vec![T::zero(); n]) };
        Tensor { dtype, shape, data }
    }

    /// A float tensor; the length must match the shape.
    pub fn from_vec(dtype: DType, shape: impl Into<Vec<usize>>, data: Vec<T>) -> Result<Self, String> {
        let shape = shape.into();
        if dtype.is_int() {
            return Err(format!("from_vec builds float tensors, {dtype} is an integer type (use from_ints)"));
        }
        let n: usize = shape.iter().product();
        if data.len() != n {
            return Err(format!("{} elements given for shape {} ({n} elements)", data.len(), shape_str(&shape)));
        }
        Ok(Tensor { dtype, shape, data: Data::Float(data) })
    }

    /// A float tensor from f64 values (converted to `T`, not rounded to `dtype`).
    pub fn from_f64s(dtype: DType, shape: impl Into<Vec<usize>>, data: &[f64]) -> Result<Self, String> {
        Tensor::from_vec(dtype, shape, data.iter().map(|&x| T::from_f64(x)).collect())
    }

    /// An integer tensor; the length must match the shape and i32 values must fit in i32.
    pub fn from_ints(dtype: DType, shape: impl Into<Vec<usize>>, data: Vec<i64>) -> Result<Self, String> {
        let shape = shape.into();
        if !dtype.is_int() {
            return Err(format!("from_ints builds integer tensors, {dtype} is a float type (use from_vec)"));
        }
        let n: usize = shape.iter().product();
        if data.len() != n {
            return Err(format!("{} elements given for shape {} ({n} elements)", data.len(), shape_str(&shape)));
        }
        if dtype == DType::I32 {
            check_i32(&data)?;
        }
        Ok(Tensor { dtype, shape, data: Data::Int(data) })
    }

    /// A rank-0 tensor holding `x` (truncated toward zero for integer dtypes).
    pub fn scalar(dtype: DType, x: f64) -> Self {
        let data = if dtype.is_int() { Data::Int(vec![x as i64]) } else { Data::Float(vec![T::from_f64(x)]) };
        Tensor { dtype, shape: Vec::new(), data }
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    pub fn floats(&self) -> Option<&[T]> {
        match &self.data {
            Data::Float(v) => Some(v),
            Data::Int(_) => None,
        }
    }

    pub fn floats_mut(&mut self) -> Option<&mut [T]> {
        match &mut self.data {
            Data::Float(v) => Some(v),
            Data::Int(_) => None,
        }
    }

    pub fn ints(&self) -> Option<&[i64]> {
        match &self.data {
            Data::Int(v) => Some(v),
            Data::Float(_) => None,
        }
    }

    /// Every element as f64 (integers converted).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        match &self.data {
            Data::Float(v) => v.iter().map(|&x| x.to_f64()).collect(),
            Data::Int(v) => v.iter().map(|&x| x as f64).collect(),
        }
    }

    /// The same tensor computed in another element type.
    pub fn convert<U: Real>(&self) -> Tensor<U> {
        let data = match &self.data {
            Data::Float(v) => Data::Float(v.iter().map(|&x| U::from_f64(x.to_f64())).collect()),
            Data::Int(v) => Data::Int(v.clone()),
        };
        Tensor { dtype: self.dtype, shape: self.shape.clone(), data }
    }

    /// Slice `i` of the leading dimension (layer `i` of a stacked parameter).
    ///
    /// # Panics
    /// If the tensor is rank 0 or `i` is out of range; see [`Tensor::try_layer`].
    pub fn layer(&self, i: usize) -> Tensor<T> {
        match self.try_layer(i) {
            Ok(t) => t,
            Err(e) => panic!("{e}"),
        }
    }

    /// Slice `i` of the leading dimension, or an error when there is none.
    pub fn try_layer(&self, i: usize) -> Result<Tensor<T>, String> {
        let Some((&lead, rest)) = self.shape.split_first() else {
            return Err("cannot take a layer of a rank-0 tensor".into());
        };
        if i >= lead {
            return Err(format!("layer {i} is out of range for a leading dimension of {lead}"));
        }
        let n: usize = rest.iter().product();
        let range = i * n..(i + 1) * n;
        if self.data.len() != lead * n {
            return Err(format!("tensor data holds {} elements, its shape {} needs {}", self.data.len(), shape_str(&self.shape), lead * n));
        }
        let data = match &self.data {
            Data::Float(v) => Data::Float(v[range].to_vec()),
            Data::Int(v) => Data::Int(v[range].to_vec()),
        };
        Ok(Tensor { dtype: self.dtype, shape: rest.to_vec(), data })
    }

    /// The type as text, `bf16[2, 3]`.
    pub fn type_string(&self) -> String {
        format!("{}{}", self.dtype, shape_str(&self.shape))
    }

    /// Check that the data matches the dtype (floats vs integers, i32 range) and the shape.
    pub fn validate(&self) -> Result<(), String> {
        match (&self.data, self.dtype.is_int()) {
            (Data::Float(_), true) => return Err(format!("{} tensor holds float data", self.dtype)),
            (Data::Int(_), false) => return Err(format!("{} tensor holds integer data", self.dtype)),
            (Data::Int(v), true) if self.dtype == DType::I32 => check_i32(v)?,
            _ => {}
        }
        let n: usize = self.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).ok_or("tensor shape overflows")?;
        if self.data.len() != n {
            return Err(format!("tensor data holds {} elements, its shape {} needs {n}", self.data.len(), shape_str(&self.shape)));
        }
        Ok(())
    }
}
