//! What `kiln train` and `kiln eval` run for the SAS tasks, from a parsed recipe to the printed
//! table: [`sudoku`] (`mdm_sudoku`, the `sas` chain, `kiln eval` of a `sas` run), [`table`] (the
//! evaluation table of every schedule) and [`gsm8k`] (`sas_gsm8k`). The binary supplies the
//! device, the run directory and a [`kiln_rl::Driver`] (trackers, progress, resume); recipe
//! validation with file:line locations stays in kiln-cli.

pub mod gsm8k;
pub mod sudoku;
pub mod table;

impl From<crate::denoiser::DenoiserError> for kiln_rl::PipelineError {
    fn from(e: crate::denoiser::DenoiserError) -> kiln_rl::PipelineError {
        kiln_rl::PipelineError::msg(e)
    }
}
