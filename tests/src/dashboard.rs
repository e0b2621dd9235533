//! What the dashboard's tests share: the tokens they log in with and a
//! way to read the API's answers.

use serde_json::Value;

/// The viewer's bearer token (`vera`) in [`token_auth`].
pub const VIEWER_TOKEN: &str = "viewer-token-of-vera-0123";
/// The operator's bearer token (`alice`) in [`token_auth`].
pub const OPERATOR_TOKEN: &str = "operator-token-of-alice-0123";

/// The token lines of `[dashboard]`: vera views, alice operates.
pub fn tokens() -> String {
    format!(
        r#"tokens = [
  {{ name = "vera", token = "{VIEWER_TOKEN}", role = "viewer" }},
  {{ name = "alice", token = "{OPERATOR_TOKEN}", role = "operator" }},
]
"#
    )
}

/// `[dashboard]` with token authentication and [`tokens`].
pub fn token_auth() -> String {
    format!("\n[dashboard]\nauth = \"token\"\n{}", tokens())
}

/// `(status, JSON body)` of a request to the dashboard (`null` for a body
/// that is not JSON).
pub async fn answer(request: reqwest::RequestBuilder) -> (u16, Value) {
    let response = request.send().await.expect("the dashboard answers");
    let status = response.status().as_u16();
    let body = response.json().await.unwrap_or(Value::Null);
    (status, body)
}
