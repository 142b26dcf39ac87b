//! `starfish certs`: a cluster CA and the certificates of its processes and operators, for
//! the demo, the tests and small installations (larger ones bring their own PKI: any CA works
//! as long as each certificate names its holder and role, see [`super::identity_of`]).
//!
//! Layout: `DIR/ca/` holds the CA's certificate and key (keep the key offline once the
//! cluster is set up); `DIR/NAME/` holds what `--tls-dir` takes: `ca-cert.pem` and the
//! identity's certificate and key (`cert.pem`/`key.pem` for host elements and elements,
//! `client-cert.pem`/`client-key.pem` for clients, the names libnbd and qemu look for).

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use time::{Duration, OffsetDateTime};

use super::Role;

/// How long certificates stay valid unless told otherwise.
pub const LEAF_DAYS_DEFAULT: i64 = 825;
const CA_DAYS: i64 = 3650;
/// Certificates start an hour in the past, for clocks slightly behind.
const BACKDATE: Duration = Duration::hours(1);

/// One certificate to make.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Subject {
    pub role: Role,
    pub name: String,
    /// Extra names and addresses it is reached at (host elements and elements); `localhost`,
    /// `127.0.0.1` and `::1` are always added, so loopback clients that check the name work.
    pub alt_names: Vec<String>,
}

impl Subject {
    /// `NAME` or `NAME=ALT,ALT…` as the command line gives it.
    pub fn parse(role: Role, text: &str) -> Result<Subject, String> {
        let (name, alt) = match text.split_once('=') {
            Some((name, alt)) => (name, alt.split(',').filter(|a| !a.is_empty()).map(str::to_owned).collect()),
            None => (text, Vec::new()),
        };
        let valid = !name.is_empty()
            && name.len() <= 64
            && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            && !name.starts_with('.');
        if !valid || name == "ca" {
            return Err(format!(
                "bad name {name:?}: use 1 to 64 letters, digits, '-', '_' or '.' (not \"ca\"); it names a directory"
            ));
        }
        Ok(Subject { role, name: name.to_owned(), alt_names: alt })
    }
}

/// Validity of the certificates made.
#[derive(Clone, Copy, Debug)]
pub struct Validity {
    pub not_after: OffsetDateTime,
}

impl Validity {
    pub fn days(days: i64) -> Validity {
        Validity { not_after: OffsetDateTime::now_utc() + Duration::days(days) }
    }

    /// The end of day `YYYY-MM-DD` (UTC).
    pub fn until(date: &str) -> Result<Validity, String> {
        let bad = || format!("bad date {date:?}: expected YYYY-MM-DD");
        let mut parts = date.splitn(3, '-');
        let (Some(y), Some(m), Some(d)) = (parts.next(), parts.next(), parts.next()) else { return Err(bad()) };
        let (y, m, d) = (
            y.parse::<i32>().map_err(|_| bad())?,
            m.parse::<u8>().map_err(|_| bad())?,
            d.parse::<u8>().map_err(|_| bad())?,
        );
        let month = time::Month::try_from(m).map_err(|_| bad())?;
        let day = time::Date::from_calendar_date(y, month, d).map_err(|_| bad())?;
        Ok(Validity { not_after: day.with_hms(23, 59, 59).map_err(|_| bad())?.assume_utc() })
    }
}

/// What was written.
#[derive(Debug)]
pub struct Made {
    pub directory: PathBuf,
    pub subject: Subject,
}

fn rcgen_error(what: &str) -> impl Fn(rcgen::Error) -> String + '_ {
    move |e| format!("{what}: {e}")
}

/// Make a new CA in `DIR/ca` and a certificate for each subject. Refuses if `DIR/ca` exists
/// (use [`add`]): a second CA would split the cluster.
pub fn init(dir: &Path, subjects: &[Subject], validity: Validity) -> Result<Vec<Made>, String> {
    let ca_dir = dir.join("ca");
    if ca_dir.exists() {
        return Err(format!(
            "{} exists: this directory has a CA already; add certificates with `starfish certs add`",
            ca_dir.display()
        ));
    }
    check_subjects(dir, subjects)?;
    let now = OffsetDateTime::now_utc();
    let ca_key = KeyPair::generate().map_err(rcgen_error("CA key"))?;
    let mut params = CertificateParams::new(Vec::<String>::new()).map_err(rcgen_error("CA"))?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "StarFish");
    // A name of its own: another cluster's CA is then an unknown issuer, not a bad signature.
    let tag = (now.unix_timestamp_nanos() as u64) ^ ((std::process::id() as u64) << 32);
    dn.push(DnType::CommonName, format!("StarFish cluster CA {tag:016x}"));
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    params.not_before = now - BACKDATE;
    params.not_after = now + Duration::days(CA_DAYS);
    let ca_cert = params.self_signed(&ca_key).map_err(rcgen_error("CA"))?;
    create_dir(&ca_dir)?;
    write(&ca_dir.join("ca-cert.pem"), &ca_cert.pem(), false)?;
    write(&ca_dir.join("ca-key.pem"), &ca_key.serialize_pem(), true)?;
    make_all(dir, subjects, validity)
}

/// Certificates for more subjects, signed by the CA in `DIR/ca`.
pub fn add(dir: &Path, subjects: &[Subject], validity: Validity) -> Result<Vec<Made>, String> {
    check_subjects(dir, subjects)?;
    make_all(dir, subjects, validity)
}

fn check_subjects(dir: &Path, subjects: &[Subject]) -> Result<(), String> {
    if subjects.is_empty() {
        return Err("name at least one --host, --element, --client or --nbd-client".into());
    }
    for (i, subject) in subjects.iter().enumerate() {
        if subjects[..i].iter().any(|s| s.name == subject.name) {
            return Err(format!("{:?} is named twice", subject.name));
        }
        let target = dir.join(&subject.name);
        if target.exists() {
            return Err(format!("{} exists already; remove it first to make a new certificate", target.display()));
        }
    }
    Ok(())
}

fn make_all(dir: &Path, subjects: &[Subject], validity: Validity) -> Result<Vec<Made>, String> {
    let ca_dir = dir.join("ca");
    let read = |name: &str| {
        std::fs::read_to_string(ca_dir.join(name))
            .map_err(|e| format!("{}: {e} (make a CA with `starfish certs init`)", ca_dir.join(name).display()))
    };
    let ca_pem = read("ca-cert.pem")?;
    let ca_key = KeyPair::from_pem(&read("ca-key.pem")?).map_err(rcgen_error("CA key"))?;
    let ca_params = CertificateParams::from_ca_cert_pem(&ca_pem).map_err(rcgen_error("CA certificate"))?;
    // Same subject and key as the stored CA certificate: what it signs chains to that one.
    let ca = ca_params.self_signed(&ca_key).map_err(rcgen_error("CA"))?;
    let now = OffsetDateTime::now_utc();
    let mut made = Vec::new();
    for subject in subjects {
        let server = matches!(subject.role, Role::Host | Role::Element);
        let mut names = vec![subject.name.clone()];
        if server {
            names.extend(subject.alt_names.iter().cloned());
            names.extend(["localhost", "127.0.0.1", "::1"].map(String::from));
        }
        names.dedup();
        let mut params = CertificateParams::new(names).map_err(rcgen_error(&subject.name))?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::OrganizationName, "StarFish");
        dn.push(DnType::OrganizationalUnitName, subject.role.as_str());
        dn.push(DnType::CommonName, subject.name.as_str());
        params.distinguished_name = dn;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        params.extended_key_usages = if server {
            vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth]
        } else {
            vec![ExtendedKeyUsagePurpose::ClientAuth]
        };
        params.not_after = validity.not_after;
        params.not_before = (now - BACKDATE).min(validity.not_after - Duration::days(1));
        let key = KeyPair::generate().map_err(rcgen_error(&subject.name))?;
        let certificate = params.signed_by(&key, &ca, &ca_key).map_err(rcgen_error(&subject.name))?;
        let target = dir.join(&subject.name);
        create_dir(&target)?;
        write(&target.join("ca-cert.pem"), &ca_pem, false)?;
        let (cert_file, key_file) =
            if server { ("cert.pem", "key.pem") } else { ("client-cert.pem", "client-key.pem") };
        write(&target.join(cert_file), &certificate.pem(), false)?;
        write(&target.join(key_file), &key.serialize_pem(), true)?;
        made.push(Made { directory: target, subject: subject.clone() });
    }
    Ok(made)
}

fn create_dir(dir: &Path) -> Result<(), String> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| format!("cannot create {}: {e}", dir.display()))
}

fn write(path: &Path, text: &str, secret: bool) -> Result<(), String> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(if secret { 0o600 } else { 0o644 })
        .open(path)
        .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
    file.write_all(text.as_bytes())
        .and_then(|()| file.sync_all())
        .map_err(|e| format!("cannot write {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn made_certificates_load_and_name_their_roles() {
        let dir = std::env::temp_dir().join(format!("starfish-certs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let subjects = vec![
            Subject::parse(Role::Host, "he1=10.0.0.5,he1.example").unwrap(),
            Subject::parse(Role::Element, "local").unwrap(),
            Subject::parse(Role::Admin, "admin").unwrap(),
        ];
        init(&dir, &subjects, Validity::days(30)).unwrap();
        for (name, role) in [("he1", Role::Host), ("local", Role::Element), ("admin", Role::Admin)] {
            let context = crate::tls::TlsContext::load(&dir.join(name)).unwrap();
            assert_eq!(context.identity(), &crate::tls::Identity { role, name: name.into() });
        }
        assert!(dir.join("admin/client-cert.pem").is_file() && dir.join("admin/client-key.pem").is_file());
        // A second init would make a second CA; adding uses the first.
        assert!(init(&dir, &[Subject::parse(Role::Element, "near").unwrap()], Validity::days(1)).is_err());
        add(&dir, &[Subject::parse(Role::Element, "near").unwrap()], Validity::days(1)).unwrap();
        assert!(add(&dir, &[Subject::parse(Role::Element, "near").unwrap()], Validity::days(1)).is_err());
        crate::tls::TlsContext::load(&dir.join("near")).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_names_and_dates_are_refused() {
        for bad in ["", "ca", "../x", "a/b", ".hidden"] {
            assert!(Subject::parse(Role::Element, bad).is_err(), "{bad:?}");
        }
        assert!(Validity::until("2020-02-30").is_err());
        assert!(Validity::until("tomorrow").is_err());
        assert_eq!(Validity::until("2020-02-29").unwrap().not_after.year(), 2020);
    }
}
