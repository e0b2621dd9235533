//! Retention's rules (contract §10): which ended orders may be deleted,
//! and when a run of batches is over. The store deletes what they name.

use crate::state::ProcessState;

/// The states an order may be deleted in once it is old enough: ended,
/// with nothing left to do. An order in `error` has an open alert: an
/// operator's turn (contract §5); live orders are live.
pub const PRUNABLE: &[ProcessState] = &[ProcessState::Processed, ProcessState::Compensated];

/// Whether an order in `state` may be deleted once it is old enough.
pub fn prunable(state: ProcessState) -> bool {
    PRUNABLE.contains(&state)
}

/// Whether another batch may find more after one that deleted `deleted`
/// orders of at most `batch`: a short batch found all there was (but the
/// orders it passed by, which the next run sees).
pub fn more_after(deleted: usize, batch: u32) -> bool {
    deleted > 0 && deleted >= batch as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_processed_and_compensated_orders_are_pruned() {
        for state in ProcessState::ALL {
            // An order in error waits for an operator; live ones are live.
            let expected = state.is_terminal() && state != ProcessState::Error;
            assert_eq!(prunable(state), expected, "{state}");
        }
    }

    #[test]
    fn batches_go_on_while_they_come_back_full() {
        assert!(more_after(2, 2));
        assert!(!more_after(1, 2));
        assert!(!more_after(0, 2));
        assert!(!more_after(0, 0), "an empty batch always ends the run");
        assert!(more_after(1000, 1000));
    }
}
