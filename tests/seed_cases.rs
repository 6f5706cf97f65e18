//! The seed's four typical bf16 cases, in release mode (ignored in debug
//! builds, where the f64 reference would take minutes).

#[path = "../examples/seed_cases.rs"]
#[allow(dead_code)]
mod seed_cases;

use npukern::{Cpu, Exec, Threads};

#[test]
#[cfg_attr(debug_assertions, ignore)]
fn seed_cases_match_reference() {
    let cpu = Cpu::new(Threads::new(2));
    let exec = Exec::new(&cpu);
    for case in &seed_cases::CASES {
        let r = seed_cases::run(case, &exec);
        println!("{:?}: {r:?}", case.shape);
        assert!(
            r.y_ulps <= seed_cases::Y_ULPS,
            "{:?}: y {} ulps",
            case.shape,
            r.y_ulps
        );
        assert!(
            r.rstd_rel <= seed_cases::RSTD_REL,
            "{:?}: rstd {:e}",
            case.shape,
            r.rstd_rel
        );
        assert!(
            r.dx_score <= seed_cases::DX_SCORE,
            "{:?}: dx {}",
            case.shape,
            r.dx_score
        );
        assert!(
            r.dgamma_rel <= seed_cases::DGAMMA_REL,
            "{:?}: dgamma {:e}",
            case.shape,
            r.dgamma_rel
        );
    }
}
